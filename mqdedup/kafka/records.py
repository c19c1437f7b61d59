"""Kafka records as mqdedup sees them: the delivery token, the message, dead-letter headers.

Pure functions and data, no broker connection: shared by the group transport
(:mod:`mqdedup.kafka.transport`), its kafka-python wrapper (:mod:`mqdedup.kafka.client`)
and replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kafka import errors as kafka_errors

from mqdedup.consumers.transport import DeadLetter
from mqdedup.kafka.offsets import PartitionKey
from mqdedup.message import HeaderValue, Message, delivered_message

#: Headers naming where a dead-lettered record came from (besides ``DeadLetter.headers()``).
SOURCE_TOPIC_HEADER = "x-mqdedup-source-topic"
SOURCE_PARTITION_HEADER = "x-mqdedup-source-partition"
SOURCE_OFFSET_HEADER = "x-mqdedup-source-offset"
SOURCE_TIMESTAMP_HEADER = "x-mqdedup-source-timestamp"
DEAD_LETTER_PREFIX = "x-mqdedup-"


@dataclass(frozen=True, slots=True, eq=False)
class KafkaToken:
    """Where a delivery came from, and the assignment epoch it was handed out in."""

    partition: PartitionKey
    offset: int
    epoch: int
    #: The original record as kafka-python returned it (key, value and header list).
    record: Any


def partition_key(topic_partition: Any) -> PartitionKey:
    """``(topic, partition)`` of a kafka-python ``TopicPartition``."""
    return (str(topic_partition.topic), int(topic_partition.partition))


#: The last record timestamp converted, as ``(milliseconds, datetime)``: records of one
#: producer batch mostly share their millisecond, and ``datetime.fromtimestamp`` is
#: the costliest step of building a message. One tuple, replaced whole: thread-safe.
_last_timestamp: list[tuple[int, datetime | None]] = [(-1, None)]


def record_timestamp(milliseconds: int | None) -> datetime | None:
    """A record's timestamp (milliseconds since the epoch) as an aware UTC datetime."""
    if milliseconds is None or milliseconds < 0:
        return None
    cached = _last_timestamp[0]
    if cached[0] == milliseconds:
        return cached[1]
    converted = datetime.fromtimestamp(milliseconds / 1000, tz=UTC)
    _last_timestamp[0] = (milliseconds, converted)
    return converted


def to_message(record: Any, redelivered: bool = False) -> Message:
    """The :class:`Message` of one kafka-python ``ConsumerRecord``. (Hot path: one call
    per record on the poll thread.)"""
    raw_headers = record.headers
    # A repeated header: the last one wins, as in lastHeader().
    headers: dict[str, HeaderValue] = dict(raw_headers) if raw_headers else {}
    value = record.value
    return delivered_message(
        value if value is not None else b"",
        record.key,
        headers,
        {},
        record.topic,
        record.partition,
        record.offset,
        record_timestamp(record.timestamp),
        redelivered,
    )


def kafka_token(partition: PartitionKey, offset: int, epoch: int, record: Any) -> KafkaToken:
    """``KafkaToken(partition, offset, epoch, record)``, about twice as cheap (the frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``)."""
    token = _new(KafkaToken)
    _set_partition(token, partition)
    _set_offset(token, offset)
    _set_epoch(token, epoch)
    _set_record(token, record)
    return token


_new = object.__new__
_set_partition, _set_offset, _set_epoch, _set_record = (
    KafkaToken.__dict__[name].__set__ for name in ("partition", "offset", "epoch", "record")
)


def dead_letter_headers(token: KafkaToken, record: DeadLetter) -> list[tuple[str, bytes]]:
    """The original headers (minus old ``x-mqdedup-*`` ones) plus the dead-letter headers."""
    original = [
        (name, value if value is not None else b"")
        for name, value in (token.record.headers or ())
        if not name.startswith(DEAD_LETTER_PREFIX)
    ]
    added = {
        **record.headers(),
        SOURCE_TOPIC_HEADER: token.partition[0],
        SOURCE_PARTITION_HEADER: str(token.partition[1]),
        SOURCE_OFFSET_HEADER: str(token.offset),
    }
    if token.record.timestamp is not None and token.record.timestamp >= 0:
        added[SOURCE_TIMESTAMP_HEADER] = str(token.record.timestamp)
    return original + [(name, value.encode("utf-8")) for name, value in added.items()]


def describe_error(error: BaseException | None) -> str:
    """``ClassName: first line`` of an error (kafka-python errors never carry secrets)."""
    if error is None:
        return "unknown error"
    if isinstance(error, kafka_errors.BrokerResponseError):
        detail = error.args[0] if error.args and error.args[0] is not None else None
        description = str(getattr(error, "description", "") or "").split(". ")[0]
        return f"{type(error).__name__}: {detail if detail is not None else description}"
    name = type(error).__name__
    text = str(error).strip().splitlines()
    first = text[0].removeprefix(f"{name}: ") if text else ""
    return f"{name}: {first}" if first else name


def is_retriable(error: BaseException) -> bool:
    """A kafka-python error that a later poll may not see again (connection, timeout)."""
    return bool(getattr(error, "retriable", False)) or isinstance(
        error,
        kafka_errors.KafkaConnectionError
        | kafka_errors.KafkaTimeoutError
        | kafka_errors.NodeNotReadyError,
    )
