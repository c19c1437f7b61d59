"""Pure AMQP helpers: deliveries to messages, dead-letter copies, ack planning.

No I/O here, so everything is unit-tested without a broker.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
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

#: AMQP types of the basic properties (values of :data:`PROPERTY_FIELDS`).
SHORT_STRING, TABLE, OCTET, TIMESTAMP = "short string", "table", "octet", "timestamp"
_FLAGS = pika.BasicProperties
#: The 14 basic properties in wire order: (flag bit, attribute, AMQP type). The
#: delivery decoder (``io_frames``) and the relay's publish encoder (``publish_frames``)
#: both walk it.
PROPERTY_FIELDS: tuple[tuple[int, str, str], ...] = (
    (_FLAGS.FLAG_CONTENT_TYPE, "content_type", SHORT_STRING),
    (_FLAGS.FLAG_CONTENT_ENCODING, "content_encoding", SHORT_STRING),
    (_FLAGS.FLAG_HEADERS, "headers", TABLE),
    (_FLAGS.FLAG_DELIVERY_MODE, "delivery_mode", OCTET),
    (_FLAGS.FLAG_PRIORITY, "priority", OCTET),
    (_FLAGS.FLAG_CORRELATION_ID, "correlation_id", SHORT_STRING),
    (_FLAGS.FLAG_REPLY_TO, "reply_to", SHORT_STRING),
    (_FLAGS.FLAG_EXPIRATION, "expiration", SHORT_STRING),
    (_FLAGS.FLAG_MESSAGE_ID, "message_id", SHORT_STRING),
    (_FLAGS.FLAG_TIMESTAMP, "timestamp", TIMESTAMP),
    (_FLAGS.FLAG_TYPE, "type", SHORT_STRING),
    (_FLAGS.FLAG_USER_ID, "user_id", SHORT_STRING),
    (_FLAGS.FLAG_APP_ID, "app_id", SHORT_STRING),
    (_FLAGS.FLAG_CLUSTER_ID, "cluster_id", SHORT_STRING),
)
#: AMQP basic properties copied into ``Message.properties`` (when set): all but headers.
PROPERTY_NAMES: tuple[str, ...] = tuple(
    name for _, name, kind in PROPERTY_FIELDS if kind is not TABLE
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
    try:
        return json.dumps(value, default=str, sort_keys=True)
    except (TypeError, ValueError):  # a nested table's key that is not UTF-8 (bytes)
        return json.dumps(_text_keys(value), default=str, sort_keys=True)


def _text_keys(value: Any) -> Any:
    """``value`` with every table key as text (JSON objects have text keys only)."""
    if isinstance(value, dict):
        return {
            (key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)): (
                _text_keys(item)
            )
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_text_keys(item) for item in value]
    return value


def delivery_attempt(redelivered: bool, headers: Mapping[str, Any]) -> int:
    """Which delivery this is: quorum queues count; classic queues only flag redeliveries."""
    count = headers.get(DELIVERY_COUNT_HEADER)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count + 1
    return 2 if redelivered else 1


def to_message(queue: str, method: Any, properties: Any, body: bytes | None) -> Message:
    """Build the handler's :class:`Message` from a pika delivery (``method`` is its
    ``Basic.Deliver``); see :func:`delivery_message`."""
    return delivery_message(
        queue,
        bool(method.redelivered),
        method.exchange,
        method.routing_key,
        properties,
        body,
    )


def delivery_message(
    queue: str,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    properties: Any,
    body: bytes | None,
) -> Message:
    """Build the handler's :class:`Message` from a delivery's parts.

    ``Message.properties`` is an :class:`AmqpProperties` view of ``properties`` (pika's
    ``BasicProperties``). (Hot path: one call per delivery.)
    """
    raw_headers: Mapping[str, Any] | None = properties.headers
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
    timestamp = properties.timestamp
    view = _new(AmqpProperties)
    _set_basic(view, properties)
    _set_exchange(view, exchange)
    _set_routing_key(view, routing_key)
    return delivered_message(
        body or b"",
        None,
        headers,
        view,
        queue,
        None,
        None,
        None if timestamp is None else _datetime(timestamp),
        redelivered,
        attempt,
    )


def _datetime(timestamp: int) -> datetime | None:
    """The AMQP ``timestamp`` property as a datetime; None when no datetime can hold it
    (``Message.properties["timestamp"]`` keeps the number the producer sent)."""
    try:
        return datetime.fromtimestamp(timestamp, UTC)
    except (OverflowError, OSError, ValueError):
        return None


class AmqpProperties(Mapping[str, Any]):
    """``Message.properties`` of a RabbitMQ delivery: a read-only mapping of the AMQP
    basic properties that are set (:data:`PROPERTY_NAMES`, in that order), then
    ``exchange`` and ``routing_key`` of the delivery.

    A view over pika's ``BasicProperties``, read on access: building a dict per
    delivery cost more than most handlers spend reading it. Compares equal to the dict
    with the same items; ``dict(message.properties)`` makes that dict.
    """

    __slots__ = ("_basic", "_exchange", "_routing_key")

    _basic: Any
    _exchange: str
    _routing_key: str

    def __init__(self, basic: Any, exchange: str, routing_key: str) -> None:
        self._basic = basic
        self._exchange = exchange
        self._routing_key = routing_key

    def __getitem__(self, key: str) -> Any:
        if key in _PROPERTY_SET:
            value = getattr(self._basic, key)
            if value is not None:
                return value
        elif key == "exchange":
            return self._exchange
        elif key == "routing_key":
            return self._routing_key
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        """The property, or ``default`` when it is not set."""
        if key in _PROPERTY_SET:
            value = getattr(self._basic, key)
            return default if value is None else value
        if key == "exchange":
            return self._exchange
        if key == "routing_key":
            return self._routing_key
        return default

    def __contains__(self, key: object) -> bool:
        if key in _PROPERTY_SET:
            return getattr(self._basic, key) is not None
        return key in _DELIVERY_KEYS

    def __iter__(self) -> Iterator[str]:
        basic = self._basic
        for name in PROPERTY_NAMES:
            if getattr(basic, name) is not None:
                yield name
        yield "exchange"
        yield "routing_key"

    def __len__(self) -> int:
        basic = self._basic
        return 2 + sum(1 for name in PROPERTY_NAMES if getattr(basic, name) is not None)

    def __repr__(self) -> str:
        return repr(dict(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (AmqpProperties, (self._basic, self._exchange, self._routing_key))


_PROPERTY_SET = frozenset(PROPERTY_NAMES)
_DELIVERY_KEYS = frozenset(("exchange", "routing_key"))
_new = object.__new__
_set_basic, _set_exchange, _set_routing_key = (
    AmqpProperties.__dict__[name].__set__ for name in ("_basic", "_exchange", "_routing_key")
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
    return _persistent_copy(original, headers)


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
    return _persistent_copy(dead_lettered, headers)


def _persistent_copy(original: Any, headers: dict[str, Any]) -> pika.BasicProperties:
    """``original``'s properties with ``headers``, persistent, without ``expiration``
    and ``user_id`` (both copies carry them in headers, see the two functions above)."""
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
