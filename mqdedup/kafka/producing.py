"""Sending from your own kafka-python producer what a mqdedup consumer needs.

::

    from kafka import KafkaProducer
    from mqdedup.kafka.producing import send_message

    producer = KafkaProducer(bootstrap_servers="localhost:9092", acks="all")
    message_id = send_message(producer, "orders", {"order": 1}, key=b"order-1")

:func:`send_message` stamps the ``message-id`` header (a new time-ordered UUIDv7 unless
you pass ``message_id=``: keep the id of a message you send again, so the resend is a
duplicate), ``content-type`` and the current trace context, and waits for the broker's
acknowledgement. :func:`stamp_headers` gives the headers alone, for a producer call of
your own. See :mod:`mqdedup.stamping` and ``docs/producers.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mqdedup.errors import BrokerUnavailableError
from mqdedup.kafka.settings import bootstrap_list
from mqdedup.stamping import stamp

__all__ = ["open_producer", "send_message", "stamp_headers"]


def stamp_headers(
    headers: Mapping[str, str | bytes] | None = None,
    *,
    message_id: str | None = None,
    content_type: str = "application/json",
) -> list[tuple[str, bytes]]:
    """Kafka record headers with ``message-id`` (a new UUIDv7 unless given),
    ``content-type`` and the trace context, then ``headers``: for
    ``producer.send(topic, value, headers=stamp_headers(...))``."""
    stamped = stamp(b"", message_id=message_id, content_type=content_type, headers=headers)
    return [(name, value.encode("utf-8")) for name, value in stamped.headers.items()]


def send_message(
    producer: Any,
    topic: str,
    body: Any,
    *,
    key: bytes | str | None = None,
    message_id: str | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    content_type: str | None = None,
    partition: int | None = None,
    timeout: float | None = 30.0,
) -> str:
    """Send ``body`` to ``topic`` with a kafka-python ``KafkaProducer``; return its
    message id.

    ``body``: bytes (sent as they are), text, or JSON (a dict, a list, a pydantic
    model, a msgspec Struct, a dataclass). ``timeout``: seconds to wait for the broker's
    acknowledgement (its error is raised); None sends without waiting (call
    ``producer.flush()`` before you rely on it). The producer must have no
    ``value_serializer`` / ``key_serializer``: the body is encoded here.
    """
    stamped = stamp(body, message_id=message_id, content_type=content_type, headers=headers)
    future = producer.send(
        topic,
        value=stamped.body,
        key=key.encode("utf-8") if isinstance(key, str) else key,
        headers=[(name, value.encode("utf-8")) for name, value in stamped.headers.items()],
        partition=partition,
    )
    if timeout is not None:
        future.get(timeout=timeout)
    return stamped.message_id


def open_producer(bootstrap_servers: str, *, timeout: float = 10.0, **config: Any) -> Any:
    """A kafka-python ``KafkaProducer`` with the settings a producer of dedup'd messages
    wants: ``acks="all"`` and idempotence (its own retries write no copy), bounded waits.

    Raises :class:`~mqdedup.errors.BrokerUnavailableError` when no broker answers.
    """
    import kafka
    from kafka.errors import KafkaError

    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap_list(bootstrap_servers),
        "acks": "all",
        "enable_idempotence": True,
        "max_block_ms": int(timeout * 1000),
        "request_timeout_ms": int(timeout * 1000),
        "client_id": "mqdedup-publish",
        **config,
    }
    try:
        return kafka.KafkaProducer(**settings)
    except KafkaError as error:
        raise BrokerUnavailableError(
            f"Kafka at {bootstrap_servers} is not reachable: {type(error).__name__}: {error}"
        ) from None
