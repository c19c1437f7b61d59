"""The ``kafka`` place: dead letters in Kafka dead-letter topics (``<topic>.DLT``).

:class:`~mqdedup.kafka.dead_letters.KafkaDeadLetters` writes each dead letter as the
original record (key, value, headers) plus ``x-mqdedup-*`` headers: the reason, the
consumer, the attempts, the error and the source topic / partition / offset.
:class:`KafkaDeadLetterTopics` reads them back without a consumer group (nothing is
committed; the live consumers are not disturbed). A key is ``topic:partition:offset``.

A topic cannot drop one record: deleting, replaying or requeueing a dead letter marks it
in ``<prefix>handled_dead_letters`` (:class:`~mqdedup.deadletters.handled.HandledMarks`),
and marked records are no longer listed, shown or counted. Retention removes the records
themselves in time. A requeue publishes the original record (its ``x-mqdedup-*`` headers
removed, its message id header kept) to the source topic with ``acks=all`` and marks it
only once the broker acknowledged the copy: a crash in between leaves it in both places,
and the consumer's claims make the second copy a duplicate.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import kafka
import kafka.errors as kafka_errors
from kafka.structs import TopicPartition
from sqlalchemy import Engine

from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.deadletters.attempts import forget_attempts
from mqdedup.deadletters.handled import HandledMarks
from mqdedup.deadletters.records import (
    DeadLetterKeyError,
    DeadLetterRecord,
    Place,
    broker_record,
    header_int,
    text_headers,
)
from mqdedup.dedup.ids import DEFAULT_HEADER
from mqdedup.errors import BrokerUnavailableError
from mqdedup.kafka.records import (
    DEAD_LETTER_PREFIX,
    SOURCE_OFFSET_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
    describe_error,
    record_timestamp,
    to_message,
)
from mqdedup.kafka.settings import bootstrap_list
from mqdedup.message import Message

log = logging.getLogger(__name__)

PLACE: Final[Place] = "kafka"
#: The suffix of dead-letter topics found when no topic is named (the default name).
DLT_SUFFIX: Final = ".DLT"
#: The longest a read, a lookup or a requeue's acknowledgement may take (seconds).
DEFAULT_TIMEOUT: Final = 20.0

_Records = list[DeadLetterRecord]  # (``list`` is a method's name in the class)
_Keys = list[str]


class KafkaDeadLetterTopics:
    """Dead letters in Kafka dead-letter topics (a :class:`DeadLetterPlace`).

    ``topics``: the dead-letter topics; None: every topic whose name ends in ``.DLT``.
    ``engine`` holds the handled marks (and the attempt counts a requeue forgets).
    ``client_config``: extra kafka-python settings (security, timeouts) for the reading
    consumer, the producer and the admin client; keys a client does not know are skipped.
    """

    place: Place = PLACE

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        engine: Engine,
        *,
        topics: Sequence[str] | None = None,
        prefix: str = DEFAULT_PREFIX,
        client_config: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.bootstrap_servers = bootstrap_list(bootstrap_servers)
        self.engine = engine
        self.prefix = prefix
        self.marks = HandledMarks(engine, PLACE, prefix)
        self.timeout = timeout
        self._topics = list(topics) if topics is not None else None
        self._config = dict(client_config or {})

    @classmethod
    def for_consumer(
        cls, consumer: Any, engine: Engine, *, timeout: float = DEFAULT_TIMEOUT
    ) -> KafkaDeadLetterTopics:
        """The dead-letter topics of a :class:`~mqdedup.kafka.consumer.KafkaConsumer`
        (its ``dead_letter_topic`` for each of its ``topics``; a pattern consumer's:
        every ``.DLT`` topic), with its bootstrap servers and client settings."""
        settings = consumer.kafka_settings()
        topics = (
            sorted({settings.dead_letter_topic_for(topic) for topic in settings.topics})
            if settings.topics
            else None
        )
        return cls(
            settings.bootstrap_servers,
            engine,
            topics=topics,
            prefix=consumer.table_prefix,
            client_config=settings.admin_config,  # (its servers and client id are replaced)
            timeout=timeout,
        )

    # -- the protocol ---------------------------------------------------------------------

    def topics(self) -> list[str]:
        """The dead-letter topics this place reads (those that exist)."""
        with self._admin() as admin:
            existing = set(admin.list_topics())
        if self._topics is not None:
            return [topic for topic in self._topics if topic in existing]
        return sorted(topic for topic in existing if topic.endswith(DLT_SUFFIX))

    def list(self, *, consumer: str | None = None, limit: int = 100) -> list[DeadLetterRecord]:
        """Up to ``limit`` unhandled dead letters, oldest first (by record timestamp)."""
        found: list[DeadLetterRecord] = []
        for topic in self.topics():
            found.extend(self._read_topic(topic, consumer))
        found.sort(key=_order)
        return found[:limit]

    def get(self, key: str) -> DeadLetterRecord | None:
        """The dead letter at ``topic:partition:offset`` (None: gone, or handled)."""
        topic, partition, offset = parse_key(key)
        if self._topics is not None and topic not in self._topics:
            raise DeadLetterKeyError(f"{topic!r} is not one of this place's dead-letter topics")
        if self.marks.marked([key]):
            return None
        with self._reader() as reader:
            _, first, end = _offset_range(reader, topic)
            if not _held(first, end, key):
                return None
            tp = TopicPartition(topic, partition)
            reader.assign([tp])
            reader.seek(tp, offset)
            for raw in self._poll_until(reader, {tp: offset + 1}):
                if raw.offset == offset:
                    return record_of(raw)
        return None

    def depth(self) -> int:
        """Unhandled dead letters in every dead-letter topic."""
        return sum(self.depths().values())

    def depths(self) -> dict[str, int]:
        """Unhandled dead letters per dead-letter topic (records minus handled marks)."""
        # A named topic not created yet (no dead letter so far) holds none.
        depths: dict[str, int] = dict.fromkeys(self._topics or (), 0)
        topics = self.topics()
        if not topics:
            return depths
        with self._reader() as reader:
            for topic in topics:
                tps, first, end = _offset_range(reader, topic)
                total = sum(end[tp] - first[tp] for tp in tps)
                marks = self.marks.marked_with_prefix(f"{topic}:")
                handled = sum(1 for key in marks if _held(first, end, key))
                depths[topic] = max(total - handled, 0)
        return depths

    def delete(self, keys: Sequence[str], *, action: str = "deleted") -> int:
        """Mark these dead letters handled (``action``: deleted / replayed / requeued)."""
        return self.marks.mark(self._present(keys), action)

    def requeue(self, keys: Sequence[str]) -> int:
        """Publish each to its source topic (acknowledged), then mark it handled."""
        records = [r for r in (self.get(key) for key in dict.fromkeys(keys)) if r is not None]
        movable = [r for r in records if r.headers.get(SOURCE_TOPIC_HEADER)]
        for record in records:
            if record not in movable:
                log.warning(
                    "dead letter names no source topic; left in place",
                    extra={"dead_letter": record.key},
                )
        if not movable:
            return 0
        forget_attempts(self.engine, movable, self.prefix)
        producer = self._client(
            kafka.KafkaProducer,
            acks="all",
            enable_idempotence=True,
            client_id="mqdedup-dead-letters-requeue",
        )
        moved = 0
        try:
            for record in movable:
                target = record.headers[SOURCE_TOPIC_HEADER]
                headers = [  # (``record_of`` left the x-mqdedup-* ones out of the message)
                    (name, value if isinstance(value, bytes) else str(value or "").encode())
                    for name, value in record.message.headers.items()
                ]
                future = producer.send(
                    target, key=record.message.key, value=record.body, headers=headers
                )
                try:
                    future.get(timeout=self.timeout)
                except kafka_errors.KafkaError as error:
                    raise BrokerUnavailableError(
                        f"requeueing {record.key} to {target!r} failed: {describe_error(error)} "
                        f"({moved} requeued before it)"
                    ) from error
                moved += self.marks.mark([record.key], "requeued")
        finally:
            producer.close(timeout=self.timeout)
        log.info("requeued dead letters", extra={"count": moved})
        return moved

    # -- internals ------------------------------------------------------------------------

    def _present(self, keys: Sequence[str]) -> _Keys:
        """The keys that name a record still in its topic (one reader for all of them)."""
        parsed = {key: parse_key(key) for key in dict.fromkeys(keys)}
        for topic, _, _ in parsed.values():
            if self._topics is not None and topic not in self._topics:
                raise DeadLetterKeyError(f"{topic!r} is not one of this place's dead-letter topics")
        if not parsed:
            return []
        with self._reader() as reader:
            ranges = {topic: _offset_range(reader, topic) for topic, _, _ in parsed.values()}
        return [key for key, (topic, _, _) in parsed.items() if _held(*ranges[topic][1:], key)]

    def _read_topic(self, topic: str, consumer: str | None) -> _Records:
        handled = self.marks.marked_with_prefix(f"{topic}:")
        records: _Records = []
        with self._reader() as reader:
            _, first, ends = _offset_range(reader, topic)
            end = {tp: stop for tp, stop in ends.items() if stop > first[tp]}
            reader.assign(list(end))
            for tp in end:
                reader.seek(tp, first[tp])
            for raw in self._poll_until(reader, end):
                if f"{raw.topic}:{raw.partition}:{raw.offset}" in handled:
                    continue
                record = record_of(raw)
                if consumer is None or record.consumer == consumer:
                    records.append(record)
        return records

    def _poll_until(self, reader: Any, end: Mapping[Any, int]) -> Iterator[Any]:
        """The records of each partition up to its end offset (exclusive)."""
        waiting = {tp: stop for tp, stop in end.items()}
        deadline = time.monotonic() + self.timeout
        while waiting:
            if time.monotonic() > deadline:
                raise BrokerUnavailableError(
                    f"reading the dead-letter topic timed out after {self.timeout:.0f} s"
                )
            for tp, batch in reader.poll(timeout_ms=500, max_records=500).items():
                stop = waiting.get(tp)
                if stop is None:
                    continue
                for raw in batch:
                    if raw.offset < stop:
                        yield raw
            for tp in list(waiting):
                if reader.position(tp) >= waiting[tp]:
                    del waiting[tp]
                    reader.pause(tp)

    def _client(self, factory: Any, **fixed: Any) -> Any:
        """A kafka-python client (``factory``) with the place's settings it knows."""
        known = {key: value for key, value in self._config.items() if key in factory.DEFAULT_CONFIG}
        try:
            return factory(**{**known, "bootstrap_servers": self.bootstrap_servers, **fixed})
        except kafka_errors.KafkaError as error:
            raise BrokerUnavailableError(
                f"cannot reach Kafka at {','.join(self.bootstrap_servers)}: {describe_error(error)}"
            ) from error

    def _reader(self) -> contextlib.closing[Any]:
        """A consumer outside any group that commits nothing: it reads, never moves."""
        return contextlib.closing(
            self._client(
                kafka.KafkaConsumer,
                group_id=None,
                enable_auto_commit=False,
                client_id="mqdedup-dead-letters",
            )
        )

    def _admin(self) -> contextlib.closing[Any]:
        return contextlib.closing(
            self._client(kafka.KafkaAdminClient, client_id="mqdedup-dead-letters-admin")
        )


def parse_key(key: str) -> tuple[str, int, int]:
    """``topic:partition:offset`` as its parts (topic names never hold ``:``)."""
    parts = key.strip().rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise DeadLetterKeyError(
            f"{key!r} is not a key of the kafka place (topic:partition:offset, e.g. orders.DLT:0:5)"
        )
    return parts[0], int(parts[1]), int(parts[2])


def record_of(raw: Any) -> DeadLetterRecord:
    """The :class:`DeadLetterRecord` of one record of a dead-letter topic.

    ``message`` is the original record as its consumer saw it: the source topic,
    partition and offset, without the ``x-mqdedup-*`` headers.
    """
    delivered = to_message(raw)
    headers = text_headers(delivered.headers)
    original_headers = {
        name: value
        for name, value in delivered.headers.items()
        if not name.startswith(DEAD_LETTER_PREFIX)
    }
    source_topic = headers.get(SOURCE_TOPIC_HEADER) or raw.topic
    partition = header_int(headers, SOURCE_PARTITION_HEADER)
    offset = header_int(headers, SOURCE_OFFSET_HEADER)
    message = Message(
        body=delivered.body,
        key=delivered.key,
        headers=original_headers,
        source=source_topic,
        partition=partition,
        offset=offset,
        timestamp=delivered.timestamp,
    )
    return broker_record(
        PLACE,
        f"{raw.topic}:{raw.partition}:{raw.offset}",
        headers,
        source=message.coordinates,
        message_id=headers.get(DEFAULT_HEADER),
        body=delivered.body,
        dead_lettered_at=record_timestamp(raw.timestamp),
        message=message,
    )


def _offset_range(reader: Any, topic: str) -> tuple[list[Any], dict[Any, int], dict[Any, int]]:
    """The partitions of ``topic`` with their first and end offsets (by ``TopicPartition``)."""
    tps = [TopicPartition(topic, p) for p in sorted(reader.partitions_for_topic(topic) or ())]
    if not tps:
        return [], {}, {}
    return tps, reader.beginning_offsets(tps), reader.end_offsets(tps)


def _held(first: Mapping[Any, int], end: Mapping[Any, int], key: str) -> bool:
    """Whether the record ``key`` is still in its topic (between first and end offsets)."""
    try:
        topic, partition, offset = parse_key(key)
    except DeadLetterKeyError:
        return False
    tp = TopicPartition(topic, partition)
    return tp in first and first[tp] <= offset < end[tp]


def _order(record: DeadLetterRecord) -> tuple[float, str, int, int]:
    topic, partition, offset = parse_key(record.key)
    stamp = record.dead_lettered_at.timestamp() if record.dead_lettered_at else 0.0
    return stamp, topic, partition, offset
