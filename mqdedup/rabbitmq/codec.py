"""Pure AMQP helpers: deliveries to messages, dead-letter copies, ack planning.

No I/O here, so everything is unit-tested without a broker.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pika

from mqdedup.consumers.transport import DeadLetter
from mqdedup.message import HeaderValue, Message, delivered_message

#: Header naming the queue a dead-lettered message came from (the requeue target).
SOURCE_QUEUE_HEADER = "x-mqdedup-source-queue"
#: Header with the message id the consumer computed (absent when the message had none).
MESSAGE_ID_HEADER = "x-mqdedup-message-id"
#: When the copy was dead-lettered (ISO 8601, UTC).
DEAD_LETTERED_AT_HEADER = "x-mqdedup-dead-lettered-at"
#: Original ``expiration`` / ``user_id`` properties, which the copy cannot keep.
ORIGINAL_EXPIRATION_HEADER = "x-mqdedup-original-expiration"
ORIGINAL_USER_ID_HEADER = "x-mqdedup-original-user-id"
#: How often a message was moved back from the dead-letter queue.
REQUEUED_HEADER = "x-mqdedup-requeued"
MQDEDUP_HEADER_PREFIX = "x-mqdedup-"
#: Quorum queues count redeliveries in this header.
DELIVERY_COUNT_HEADER = "x-delivery-count"

#: AMQP basic properties copied into ``Message.properties`` (when set).
PROPERTY_NAMES: tuple[str, ...] = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)
PERSISTENT = 2


def header_value(value: Any) -> HeaderValue:
    """An AMQP header value as ``Message.headers`` holds it (text, bytes or None).

    Numbers and booleans become their text; timestamps ISO 8601; tables and arrays JSON.
    The dead-lettered copy keeps the original typed values.
    """
    if value is None or isinstance(value, str | bytes):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | Decimal):
        return str(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    return json.dumps(value, default=str, sort_keys=True)


def delivery_attempt(redelivered: bool, headers: Mapping[str, Any]) -> int:
    """Which delivery this is: quorum queues count; classic queues only flag redeliveries."""
    count = headers.get(DELIVERY_COUNT_HEADER)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count + 1
    return 2 if redelivered else 1


def to_message(queue: str, method: Any, properties: Any, body: bytes | None) -> Message:
    """Build the handler's :class:`Message` from a pika delivery.

    ``properties`` holds the AMQP basic properties that are set, plus ``exchange`` and
    ``routing_key`` of the delivery. (Hot path: one call per delivery.)
    """
    # pika's BasicProperties holds the basic properties plus ``headers`` (kept apart).
    props: dict[str, Any] = {
        name: value for name, value in vars(properties).items() if value is not None
    }
    raw_headers: Mapping[str, Any] | None = props.pop("headers", None)
    props["exchange"] = method.exchange
    props["routing_key"] = method.routing_key
    redelivered = bool(method.redelivered)
    if raw_headers:
        headers: dict[str, HeaderValue] = {
            str(key): value
            if value is None or isinstance(value, str | bytes)
            else header_value(value)
            for key, value in raw_headers.items()
        }
        attempt = delivery_attempt(redelivered, raw_headers)
    else:
        headers = {}
        attempt = 2 if redelivered else 1
    timestamp = props.get("timestamp")
    return delivered_message(
        body or b"",
        None,
        headers,
        props,
        queue,
        None,
        None,
        datetime.fromtimestamp(timestamp, UTC) if timestamp is not None else None,
        redelivered,
        attempt,
    )


def dead_letter_properties(
    original: Any,
    record: DeadLetter,
    *,
    source_queue: str,
    message_id: str | None,
    now: datetime | None = None,
) -> pika.BasicProperties:
    """Properties of the dead-lettered copy: the original ones plus the reason headers.

    The copy is persistent. ``expiration`` (it would expire in the DLQ) and ``user_id``
    (the broker checks it against the publishing user) move into headers.
    """
    headers: dict[str, Any] = dict(original.headers or {})
    headers.update(record.headers())
    headers[SOURCE_QUEUE_HEADER] = source_queue
    headers[DEAD_LETTERED_AT_HEADER] = (now or datetime.now(UTC)).isoformat()
    if message_id is not None:
        headers[MESSAGE_ID_HEADER] = message_id
    if original.expiration is not None:
        headers[ORIGINAL_EXPIRATION_HEADER] = original.expiration
    if original.user_id is not None:
        headers[ORIGINAL_USER_ID_HEADER] = original.user_id
    return pika.BasicProperties(
        content_type=original.content_type,
        content_encoding=original.content_encoding,
        headers=headers,
        delivery_mode=PERSISTENT,
        priority=original.priority,
        correlation_id=original.correlation_id,
        reply_to=original.reply_to,
        message_id=original.message_id,
        timestamp=original.timestamp,
        type=original.type,
        app_id=original.app_id,
        cluster_id=original.cluster_id,
    )


def requeue_properties(dead_lettered: Any) -> pika.BasicProperties:
    """Properties for moving a dead-lettered copy back to its queue.

    The ``x-mqdedup-*`` reason headers are removed (a new failure writes fresh ones);
    ``x-mqdedup-requeued`` counts the moves. The original ``expiration`` is not restored.
    """
    old: Mapping[str, Any] = dead_lettered.headers or {}
    headers = {
        key: value for key, value in old.items() if not key.startswith(MQDEDUP_HEADER_PREFIX)
    }
    previous = old.get(REQUEUED_HEADER)
    try:
        moves = int(previous) if previous is not None else 0
    except (TypeError, ValueError):
        moves = 0
    headers[REQUEUED_HEADER] = moves + 1
    user_id = old.get(ORIGINAL_USER_ID_HEADER)
    if user_id is not None:
        headers[ORIGINAL_USER_ID_HEADER] = user_id  # kept for audit; never the property
    return pika.BasicProperties(
        content_type=dead_lettered.content_type,
        content_encoding=dead_lettered.content_encoding,
        headers=headers,
        delivery_mode=PERSISTENT,
        priority=dead_lettered.priority,
        correlation_id=dead_lettered.correlation_id,
        reply_to=dead_lettered.reply_to,
        message_id=dead_lettered.message_id,
        timestamp=dead_lettered.timestamp,
        type=dead_lettered.type,
        app_id=dead_lettered.app_id,
        cluster_id=dead_lettered.cluster_id,
    )


def header_text(headers: Mapping[str, Any] | None, name: str) -> str | None:
    """A header of a raw pika header table as text (None when absent)."""
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


@dataclass(frozen=True)
class AckPlan:
    """How to acknowledge a set of delivery tags on one channel.

    ``multiple_up_to``: one ``basic.ack(multiple=True)`` covering every outstanding tag up
    to and including it (None: no such ack). ``singles``: tags acknowledged one by one.
    """

    multiple_up_to: int | None
    singles: tuple[int, ...]

    @property
    def frames(self) -> int:
        """Number of ``basic.ack`` frames the plan sends."""
        return len(self.singles) + (1 if self.multiple_up_to is not None else 0)


def plan_acks(outstanding: Collection[int], tags: Collection[int]) -> AckPlan:
    """Plan acks for ``tags`` given every unacknowledged tag of the channel.

    ``multiple=True`` acknowledges *all* unacked tags up to a tag, so it is used only
    for the longest run of the lowest outstanding tags that are all being settled;
    the rest are acknowledged singly. Tags not outstanding are ignored (already settled
    or from another channel).
    """
    settle = {tag for tag in tags if tag in outstanding}
    if not settle:
        return AckPlan(None, ())
    prefix_end: int | None = None
    prefix_length = 0
    for tag in sorted(outstanding):
        if tag not in settle:
            break
        prefix_end = tag
        prefix_length += 1
    if prefix_length < 2:
        return AckPlan(None, tuple(sorted(settle)))
    assert prefix_end is not None
    return AckPlan(prefix_end, tuple(sorted(tag for tag in settle if tag > prefix_end)))
