"""The outbox writer: outgoing messages become rows of the caller's transaction.

Inside a handler use ``ctx.outbox``::

    def handle(self, message, ctx):
        ctx.session.execute(insert(orders).values(...))
        ctx.outbox.publish({"order": 7, "status": "accepted"}, topic="order-events", key="7")
        ctx.outbox.publish(b"...", exchange="billing", routing_key="invoice.created")

Outside a consumer (a web request, a script) wrap any SQLAlchemy session::

    with Session(engine) as session, session.begin():
        session.add(order)
        OutboxWriter(session).publish({"order": order.id}, topic="order-events", key=str(order.id))

The rows commit or roll back with the session's transaction; the relay
(:mod:`mqdedup.outbox.relay`) publishes committed rows afterwards, at least once, always
with the same message id. Ids are deterministic inside a consumer (derived from the
consumer name, the incoming message id and the row's sequence in the handler), so a
handler that runs again (retry, redelivery after a crash before commit) writes the same
ids; elsewhere they are time-ordered UUIDv7s (:func:`mqdedup.id_generators.new_message_id`)
unless given.
"""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from mqdedup import tracing
from mqdedup.db.dialects import traits
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import utcnow
from mqdedup.errors import MessageError, MqdedupError
from mqdedup.id_generators import new_message_id
from mqdedup.message import Message
from mqdedup.outbox.notify import channel_name, notify_on_commit

KAFKA = "kafka"
RABBITMQ = "rabbitmq"

#: Header carrying the outgoing message id (the Kafka consumers' default id strategy).
MESSAGE_ID_HEADER = "message-id"
#: Header carrying the id of the message whose handler wrote this one.
CAUSATION_ID_HEADER = "causation-id"
TRACE_HEADERS = ("traceparent", "tracestate")

PENDING = "pending"
PUBLISHED = "published"
FAILED = "failed"

MAX_ID_LENGTH = 255
#: AMQP basic properties a row may set (``message_id``, ``headers`` and
#: ``delivery_mode`` are set by mqdedup: the id, the ``headers`` argument, persistent).
AMQP_PROPERTIES = frozenset(
    {
        "content_type",
        "content_encoding",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "timestamp",
        "type",
        "user_id",
        "app_id",
    }
)
_ID_NAMESPACE = uuid.UUID("5b0e3f0c-6d2c-5c57-9a51-6d7164656475")

HeaderInput = str | bytes | int | float | bool


class InvalidOutgoingMessageError(MqdedupError, ValueError):
    """An outgoing message's arguments cannot be written (missing destination, bad header)."""


def outgoing_message_id(consumer_name: str, causation_id: str, sequence: int) -> str:
    """The deterministic id of the ``sequence``-th row a consumer wrote for one message."""
    return str(uuid.uuid5(_ID_NAMESPACE, f"{consumer_name}\x1f{causation_id}\x1f{sequence}"))


def shard_hash(key: bytes | None, message_id: str) -> int:
    """A stable non-negative 31-bit hash placing a row in a relay shard.

    Rows with the same key share a shard (so one relay publishes them, in order); rows
    without a key are spread by their message id.
    """
    return zlib.crc32(key if key is not None else message_id.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class OutgoingMessage:
    """One message to publish after commit; give either ``topic`` or ``exchange``.

    * Kafka: ``topic``, optional ``key`` (also the ordering key) and ``headers``.
    * RabbitMQ: ``exchange`` (``""`` is the default exchange), ``routing_key``,
      optional ``headers`` (AMQP application headers) and ``properties`` (AMQP basic
      properties such as ``content_type`` or ``correlation_id``); ``key`` is then only
      the ordering key: rows with the same key are published in commit order.

    ``payload`` is sent as is when bytes, UTF-8 encoded when str, else as JSON.
    ``delay`` postpones publication; ``cause`` is the message (or id) this one results
    from (default: the handler's incoming message); ``broker`` selects a relay
    publisher by name (default ``kafka`` / ``rabbitmq``).
    """

    payload: Any
    topic: str | None = None
    exchange: str | None = None
    routing_key: str | None = None
    key: bytes | str | None = None
    headers: Mapping[str, HeaderInput] | None = None
    properties: Mapping[str, Any] | None = None
    message_id: str | None = None
    delay: float | timedelta | None = None
    cause: Message | str | None = None
    traceparent: str | None = None
    broker: str | None = None


class OutboxWriter:
    """Adds outgoing messages to ``<prefix>outbox`` in the caller's session.

    ``consumer_name`` and ``causation_id`` make ids deterministic (``ctx.outbox`` sets
    them); ``message`` is the incoming message whose ``traceparent``/``tracestate``
    headers are passed on. One writer belongs to one handler run.
    """

    def __init__(
        self,
        session: Session,
        *,
        consumer_name: str | None = None,
        causation_id: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        message: Message | None = None,
    ) -> None:
        if hasattr(session, "sync_session"):  # sqlalchemy.ext.asyncio.AsyncSession
            raise TypeError(
                "OutboxWriter needs a synchronous Session, not an AsyncSession: use "
                "`await AsyncOutboxWriter(session).publish(...)` "
                "(from mqdedup.outbox.async_writer import AsyncOutboxWriter)"
            )
        self.session = session
        self.consumer_name = consumer_name
        self.causation_id = causation_id
        self.prefix = prefix
        self.table = schema(prefix).outbox
        # The active span's context (OpenTelemetry: the consumer span), else the
        # incoming message's trace headers passed on as they came.
        self._trace = tracing.trace_headers() or (
            _trace_headers(message) if message is not None else {}
        )
        self._sequences: dict[str, int] = {}
        self._notify: bool | None = None

    def publish(
        self,
        payload: Any,
        *,
        topic: str | None = None,
        exchange: str | None = None,
        routing_key: str | None = None,
        key: bytes | str | None = None,
        headers: Mapping[str, HeaderInput] | None = None,
        properties: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        delay: float | timedelta | None = None,
        cause: Message | str | None = None,
        traceparent: str | None = None,
        broker: str | None = None,
    ) -> str:
        """Write one outgoing message (see :class:`OutgoingMessage`); return its message id."""
        message = OutgoingMessage(
            payload=payload,
            topic=topic,
            exchange=exchange,
            routing_key=routing_key,
            key=key,
            headers=headers,
            properties=properties,
            message_id=message_id,
            delay=delay,
            cause=cause,
            traceparent=traceparent,
            broker=broker,
        )
        return self.publish_many([message])[0]

    def publish_many(self, messages: Iterable[OutgoingMessage]) -> list[str]:
        """Write several outgoing messages with one statement; return their message ids."""
        now = utcnow()
        rows = [self._row(message, now) for message in messages]
        if not rows:
            return []
        if len(rows) == 1:  # through the session: a consumer may defer it (with others)
            self.session.execute(insert(self.table), rows[0])
        else:
            self.session.connection().execute(insert(self.table), rows)
        if self._notify is None:
            self._notify = traits(self.session.get_bind()).notifies
        if self._notify:
            notify_on_commit(self.session, channel_name(self.prefix))
        return [row["message_id"] for row in rows]

    # -- building a row --------------------------------------------------------------------

    def _row(self, message: OutgoingMessage, now: Any) -> dict[str, Any]:
        broker, destination, routing_key = _destination(message)
        cause = message.cause
        causation_id = (
            (cause.id if isinstance(cause, Message) else cause)
            if cause is not None
            else self.causation_id
        )
        message_id = self._message_id(message.message_id, causation_id)
        key = _key(message.key)
        payload, is_json = _payload(message.payload)

        headers: dict[str, Any] = {MESSAGE_ID_HEADER: message_id}
        if causation_id is not None:
            headers[CAUSATION_ID_HEADER] = causation_id
        headers.update(_trace_headers(cause) if isinstance(cause, Message) else self._trace)
        if message.traceparent is not None:
            headers["traceparent"] = message.traceparent
        for name, value in _headers(message.headers).items():
            if name in (MESSAGE_ID_HEADER, CAUSATION_ID_HEADER):
                raise InvalidOutgoingMessageError(
                    f"header {name!r} is set by mqdedup; pass message_id=... or cause=... instead"
                )
            if broker == RABBITMQ and isinstance(value, float):
                # pika encodes no AMQP float type: the relay could never publish the row.
                raise InvalidOutgoingMessageError(
                    f"header {name!r} is a float, which AMQP headers sent with pika cannot "
                    "carry; pass it as str or int"
                )
            headers[name] = value

        properties: dict[str, Any] | None = None
        if message.exchange is not None:
            properties = _properties(message.properties)
            properties["message_id"] = message_id
            if is_json:
                properties.setdefault("content_type", "application/json")
        elif message.properties:
            raise InvalidOutgoingMessageError(
                "AMQP properties need a RabbitMQ destination (exchange=...), not a Kafka topic"
            )

        delay = _delay_seconds(message.delay)
        return {
            "message_id": message_id,
            "broker": broker,
            "destination": destination,
            "routing_key": routing_key,
            "message_key": key,
            "shard_hash": shard_hash(key, message_id),
            "headers": headers,
            "properties": properties,
            "payload": payload,
            "state": PENDING,
            "attempts": 0,
            "created_at": now,
            "available_at": now + timedelta(seconds=delay) if delay else now,
        }

    def _message_id(self, given: str | None, causation_id: str | None) -> str:
        if given is not None:
            if not given.strip() or len(given) > MAX_ID_LENGTH:
                raise InvalidOutgoingMessageError(
                    f"message_id must be 1 to {MAX_ID_LENGTH} characters, got {given!r:.80}"
                )
            return given
        if self.consumer_name is None or causation_id is None:
            return new_message_id()  # time-ordered: outside a consumer nothing re-runs
        sequence = self._sequences.get(causation_id, 0)
        self._sequences[causation_id] = sequence + 1
        return outgoing_message_id(self.consumer_name, causation_id, sequence)


def _destination(message: OutgoingMessage) -> tuple[str, str, str | None]:
    if (message.topic is None) == (message.exchange is None):
        raise InvalidOutgoingMessageError(
            "an outgoing message needs exactly one destination: topic=... (Kafka) "
            "or exchange=... (RabbitMQ)"
        )
    if message.topic is not None:
        if not message.topic or len(message.topic) > MAX_ID_LENGTH:
            raise InvalidOutgoingMessageError(f"invalid Kafka topic name {message.topic!r:.80}")
        if message.routing_key is not None:
            raise InvalidOutgoingMessageError(
                "routing_key is for RabbitMQ destinations (exchange=...); Kafka uses key="
            )
        return message.broker or KAFKA, message.topic, None
    exchange = str(message.exchange)
    routing_key = message.routing_key or ""
    if exchange == "" and not routing_key:
        raise InvalidOutgoingMessageError(
            "the default exchange (exchange='') needs routing_key=<queue name>"
        )
    if len(exchange) > MAX_ID_LENGTH or len(routing_key) > MAX_ID_LENGTH:
        raise InvalidOutgoingMessageError("exchange and routing_key are limited to 255 characters")
    return message.broker or RABBITMQ, exchange, routing_key


def _key(key: bytes | str | None) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8")
    raise InvalidOutgoingMessageError(f"key must be bytes or str, not {type(key).__name__}")


def _payload(payload: Any) -> tuple[bytes, bool]:
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), False
    if isinstance(payload, str):
        return payload.encode("utf-8"), False
    try:
        return json.dumps(payload, separators=(",", ":")).encode("utf-8"), True
    except (TypeError, ValueError) as error:
        raise InvalidOutgoingMessageError(
            f"payload is neither bytes, str nor JSON-serialisable: {error}"
        ) from error


def _headers(headers: Mapping[str, HeaderInput] | None) -> dict[str, Any]:
    clean: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not name:
            raise InvalidOutgoingMessageError(f"header names must be non-empty str, got {name!r}")
        if isinstance(value, bytes):
            try:
                clean[name] = value.decode("utf-8")
            except UnicodeDecodeError as error:
                raise InvalidOutgoingMessageError(
                    f"header {name!r} is not UTF-8 text (outbox headers are stored as JSON)"
                ) from error
            continue
        if not isinstance(value, str | int | float | bool):
            raise InvalidOutgoingMessageError(
                f"header {name!r} must be str, bytes, int, float or bool, "
                f"not {type(value).__name__}"
            )
        clean[name] = value
    return clean


def _properties(properties: Mapping[str, Any] | None) -> dict[str, Any]:
    clean = dict(properties or {})
    unknown = sorted(set(clean) - AMQP_PROPERTIES)
    if unknown:
        raise InvalidOutgoingMessageError(
            f"unsupported AMQP properties {unknown}; allowed: {sorted(AMQP_PROPERTIES)} "
            "(message_id, headers and delivery_mode are set by mqdedup)"
        )
    for name, value in clean.items():
        if name in ("priority", "timestamp"):
            valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            valid = valid and (name != "priority" or value <= 255)
        elif name == "expiration":
            valid = isinstance(value, str) and value.isdigit()
        else:
            valid = isinstance(value, str)
        if not valid:
            raise InvalidOutgoingMessageError(
                f"AMQP property {name}={value!r:.80} is invalid (priority: int 0-255, "
                "timestamp: epoch seconds, expiration: milliseconds as a digit string, "
                "others: str)"
            )
    return clean


def _delay_seconds(delay: float | timedelta | None) -> float:
    if delay is None:
        return 0.0
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if seconds < 0:
        raise InvalidOutgoingMessageError(f"delay must not be negative, got {seconds}")
    return seconds


def _trace_headers(message: Message) -> dict[str, str]:
    trace: dict[str, str] = {}
    for name in TRACE_HEADERS:
        try:
            value = message.header(name)
        except MessageError:
            value = None  # an undecodable trace header is dropped, never fatal
        if value:
            trace[name] = value
    return trace
