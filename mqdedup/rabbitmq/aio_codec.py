"""aio-pika deliveries as mqdedup messages, and their dead-lettered copies.

The aio-pika counterparts of :func:`mqdedup.rabbitmq.codec.to_message` and
:func:`~mqdedup.rabbitmq.codec.dead_letter_properties`: the same ``Message`` fields and
the same ``x-mqdedup-*`` headers, from aio-pika's ``IncomingMessage``. No I/O here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import aio_pika

from mqdedup.consumers.transport import DeadLetter
from mqdedup.message import HeaderValue, Message
from mqdedup.rabbitmq.codec import (
    DEAD_LETTERED_AT_HEADER,
    MESSAGE_ID_HEADER,
    ORIGINAL_EXPIRATION_HEADER,
    ORIGINAL_USER_ID_HEADER,
    PERSISTENT,
    PROPERTY_NAMES,
    SOURCE_QUEUE_HEADER,
    delivery_attempt,
    header_value,
)


def aio_to_message(queue: str, incoming: Any) -> Message:
    """The handler's :class:`Message` of one aio-pika ``IncomingMessage``.

    ``properties`` holds the AMQP basic properties that are set (``timestamp`` as epoch
    seconds, ``expiration`` as the AMQP text, as the pika transport has them) plus the
    delivery's ``exchange`` and ``routing_key``.
    """
    props: dict[str, Any] = {}
    for name in PROPERTY_NAMES:
        value = getattr(incoming, name, None)
        if value is not None:
            props[name] = value
    if "expiration" in props:
        props["expiration"] = _expiration_text(props["expiration"])
    timestamp = props.get("timestamp")
    when: datetime | None = None
    if isinstance(timestamp, datetime):
        when = timestamp if timestamp.tzinfo else timestamp.replace(tzinfo=UTC)
        props["timestamp"] = int(when.timestamp())
    elif isinstance(timestamp, int | float):
        when = datetime.fromtimestamp(timestamp, UTC)
    props["exchange"] = incoming.exchange
    props["routing_key"] = incoming.routing_key
    raw_headers = incoming.headers or {}
    headers: dict[str, HeaderValue] = {
        str(key): value if value is None or isinstance(value, str | bytes) else header_value(value)
        for key, value in raw_headers.items()
    }
    redelivered = bool(incoming.redelivered)
    return Message(
        body=incoming.body or b"",
        headers=headers,
        properties=props,
        source=queue,
        timestamp=when,
        redelivered=redelivered,
        attempt=delivery_attempt(redelivered, raw_headers),
    )


def aio_dead_letter_message(
    incoming: Any,
    record: DeadLetter,
    *,
    source_queue: str,
    message_id: str | None,
    now: datetime | None = None,
) -> aio_pika.Message:
    """The dead-lettered copy: the original body and properties plus the reason headers.

    Persistent; ``expiration`` and ``user_id`` move into headers (the copy would expire
    in the dead-letter queue; the broker checks ``user_id`` against the publisher).
    """
    headers: dict[str, Any] = dict(incoming.headers or {})
    headers.update(record.headers())
    headers[SOURCE_QUEUE_HEADER] = source_queue
    headers[DEAD_LETTERED_AT_HEADER] = (now or datetime.now(UTC)).isoformat()
    if message_id is not None:
        headers[MESSAGE_ID_HEADER] = message_id
    if incoming.expiration is not None:
        headers[ORIGINAL_EXPIRATION_HEADER] = _expiration_text(incoming.expiration)
    if incoming.user_id is not None:
        headers[ORIGINAL_USER_ID_HEADER] = incoming.user_id
    return aio_pika.Message(
        incoming.body or b"",
        headers=headers,
        content_type=incoming.content_type,
        content_encoding=incoming.content_encoding,
        delivery_mode=PERSISTENT,
        priority=incoming.priority,
        correlation_id=incoming.correlation_id,
        reply_to=incoming.reply_to,
        message_id=incoming.message_id,
        timestamp=incoming.timestamp,
        type=incoming.type,
        app_id=incoming.app_id,
    )


def _expiration_text(value: Any) -> str:
    """The AMQP ``expiration`` text (milliseconds) of aio-pika's decoded seconds."""
    if isinstance(value, int | float):
        return str(round(value * 1000))
    return str(value)
