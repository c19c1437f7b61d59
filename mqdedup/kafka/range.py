"""A Kafka transport over a past range of offsets: what a replay runs.

It assigns explicit partitions (it never joins the consumer group and commits
nothing), seeks each to the start of the range (an offset, or a timestamp through
``offsets_for_times``) and stops at the end of the range (an offset or a timestamp,
exclusive; default: the end offsets when the range is opened). ``fetch`` blocks until
it has deliveries of the range, and returns ``[]`` only once every partition reached
its end, so ``Worker.run(until_idle=True)`` reads exactly the range.

Threads: one. The Worker's thread opens, fetches, settles, dead-letters and closes; no
group membership means nothing has to keep polling while a batch is processed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import kafka
import kafka.errors as kafka_errors
from kafka.structs import TopicPartition

from mqdedup.consumers.replay import RangeLedger
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.kafka.dead_letters import KafkaDeadLetters
from mqdedup.kafka.offsets import PartitionKey
from mqdedup.kafka.records import (
    KafkaToken,
    describe_error,
    is_retriable,
    partition_key,
    to_message,
)
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.kafka.offset_store import StoredOffsets
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)

Bound = int | datetime | None


class KafkaRangeTransport:
    """The :class:`~mqdedup.consumers.replay.RangeTransport` of a Kafka replay.

    ``give_back`` hands the given deliveries out again (first, marked redelivered):
    the records are those of the range, so this is the seek back to them without
    reading again what was settled after them. A fetch that sees no record for
    ``idle_timeout`` seconds while partitions are left raises
    :class:`~mqdedup.errors.BrokerUnavailableError`.
    """

    #: The group's stored offsets (``offsets_in_database``), read-only: set by the replay.
    positions: StoredOffsets | None = None

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        topics: Sequence[str],
        partitions: Sequence[int] | None = None,
        start: Bound = None,
        end: Bound = None,
        stop: StopToken | None = None,
        idle_timeout: float = 60.0,
    ) -> None:
        self.settings = settings
        self.topics = list(topics)
        if not self.topics:
            raise ConfigurationError(
                f"replay of {settings.consumer_name} needs topics=[...] "
                "(it subscribes by topic_pattern)"
            )
        self.partitions = list(partitions) if partitions is not None else None
        self.start, self.end = start, end
        self.stop = stop or StopToken()
        self.idle_timeout = idle_timeout
        self.ledger = RangeLedger()
        #: Per partition of the range: the first offset and the end (exclusive).
        self.starts: dict[PartitionKey, int] = {}
        self.ends: dict[PartitionKey, int] = {}
        self._active: dict[PartitionKey, int] = {}
        self._again: list[Delivery[KafkaToken]] = []
        self._client: Any = None
        self._dead_letters: KafkaDeadLetters | None = None
        self._closed = False

    # -- life cycle ----------------------------------------------------------------------

    def open(self) -> None:
        """Connect, resolve the range per partition, assign and seek (idempotent)."""
        if self._client is not None:
            return
        config = {**self.settings.consumer_config, "group_id": None}
        try:
            self._client = kafka.KafkaConsumer(**config)
        except kafka_errors.KafkaConfigurationError as error:
            raise ConfigurationError(f"invalid Kafka settings: {error}") from error
        except kafka_errors.KafkaError as error:
            servers = ",".join(self.settings.bootstrap_servers)
            raise BrokerUnavailableError(f"cannot reach Kafka at {servers}: {error}") from error
        keys = self._partitions()
        self.starts, self.ends = self._offset_range(keys)
        for key in keys:
            self.ledger.ranges[f"{key[0]}/{key[1]}"] = (self.starts[key], self.ends[key])
            if self.starts[key] < self.ends[key]:
                self._active[key] = self.ends[key]
        self._client.assign([TopicPartition(*key) for key in self._active])
        for key in self._active:
            self._client.seek(TopicPartition(*key), self.starts[key])
        self._dead_letters = KafkaDeadLetters(self.settings)

    def close(self) -> None:
        """Disconnect; nothing is committed (unsettled records are simply not read again)."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close(autocommit=False)
            except Exception as error:
                log.warning(
                    "kafka consumer did not close cleanly",
                    extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
                )
        if self._dead_letters is not None:
            self._dead_letters.close(10.0)

    # -- the Transport protocol ----------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[KafkaToken]]:
        """Up to ``max_messages`` deliveries of the range; ``[]`` once it is all read."""
        if self._again:
            batch, self._again = self._again[:max_messages], self._again[max_messages:]
            for delivery in batch:
                self.ledger.handed_out(_position(delivery))
            return batch
        client = self._opened()
        waiting_since = time.monotonic()
        while self._active and not self.stop.requested:
            deliveries = self._poll(client, max_messages, timeout)
            if deliveries:
                return deliveries
            if self._active and time.monotonic() - waiting_since > self.idle_timeout:
                raise BrokerUnavailableError(
                    f"replay made no progress for {self.idle_timeout:.0f} s "
                    f"(partitions left: {sorted(self._active)})"
                )
        return []

    def settle(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Count deliveries as done (a replay commits no offsets)."""
        for delivery in deliveries:
            self.ledger.settle(_position(delivery))

    def give_back(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Hand these unsettled deliveries out again, before the rest of the range."""
        again = [
            Delivery(dataclasses.replace(d.message, redelivered=True), d.token) for d in deliveries
        ]
        self._again = again + self._again

    def dead_letter(self, delivery: Delivery[KafkaToken], record: DeadLetter) -> None:
        """Publish to the consumer's dead-letter topic, as the live transport does."""
        token = delivery.token
        if not isinstance(token, KafkaToken):
            raise TypeError("not a Kafka delivery")
        if self._dead_letters is None or self._closed:
            raise BrokerUnavailableError("the Kafka range transport is not open")
        self.ledger.dead_lettering(_position(delivery), record.reason)
        self._dead_letters.publish(token, record)

    def keepalive(self) -> None:
        """Nothing to keep alive: no group membership, no poll deadline."""

    # -- the range -----------------------------------------------------------------------

    def offsets_for_times(
        self, partitions: Sequence[PartitionKey], when: datetime
    ) -> dict[PartitionKey, int | None]:
        """The first offset at or after ``when`` per partition (None: no such record)."""
        found = self._opened().offsets_for_times(
            {TopicPartition(*key): int(when.timestamp() * 1000) for key in partitions},
            timeout_ms=int(self.settings.commit_timeout * 1000),
        )
        return {
            partition_key(tp): (None if value is None else int(value.offset))
            for tp, value in found.items()
        }

    def _partitions(self) -> list[PartitionKey]:
        """The (topic, partition) pairs of the range; unknown partitions are refused."""
        keys: list[PartitionKey] = []
        for topic in self.topics:
            found = self._opened().partitions_for_topic(topic)
            if not found:
                raise ConfigurationError(f"Kafka topic {topic!r} does not exist")
            existing = sorted(int(p) for p in found)
            chosen = existing if self.partitions is None else self.partitions
            missing = sorted(set(chosen) - set(existing))
            if missing:
                raise ConfigurationError(
                    f"Kafka topic {topic!r} has no partition(s) {missing} (it has {len(existing)})"
                )
            keys.extend((topic, p) for p in sorted(set(chosen)))
        return keys

    def _offset_range(
        self, keys: list[PartitionKey]
    ) -> tuple[dict[PartitionKey, int], dict[PartitionKey, int]]:
        """Per partition: the first offset to read and the end (exclusive), clamped to
        what the log still holds."""
        client = self._opened()
        partitions = [TopicPartition(*key) for key in keys]
        first = _by_key(client.beginning_offsets(partitions))
        last = _by_key(client.end_offsets(partitions))
        starts = self._resolve(keys, self.start, default=first, beyond=last)
        ends = self._resolve(keys, self.end, default=last, beyond=last)
        return (
            {k: max(starts[k], first[k]) for k in keys},
            {k: min(ends[k], last[k]) for k in keys},
        )

    def _resolve(
        self,
        keys: list[PartitionKey],
        bound: Bound,
        *,
        default: dict[PartitionKey, int],
        beyond: dict[PartitionKey, int],
    ) -> dict[PartitionKey, int]:
        if bound is None:
            return dict(default)
        if isinstance(bound, datetime):
            if bound.tzinfo is None:
                raise ConfigurationError("replay timestamps must be timezone-aware")
            found = self.offsets_for_times(keys, bound)
            return {k: beyond[k] if found.get(k) is None else int(found[k] or 0) for k in keys}
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ConfigurationError(f"replay offsets must be non-negative integers, not {bound!r}")
        return dict.fromkeys(keys, bound)

    # -- internals -----------------------------------------------------------------------

    def _opened(self) -> Any:
        if self._client is None:
            if self._closed:
                raise BrokerUnavailableError("the Kafka range transport is closed")
            self.open()
        return self._client

    def _poll(self, client: Any, max_messages: int, timeout: float) -> list[Delivery[KafkaToken]]:
        """One poll: the records still inside the range; partitions at their end leave."""
        try:
            batches = client.poll(timeout_ms=int(timeout * 1000), max_records=max_messages)
        except kafka_errors.KafkaError as error:
            if not is_retriable(error):
                raise
            log.warning(
                "kafka poll failed; retrying",
                extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
            )
            return []
        deliveries: list[Delivery[KafkaToken]] = []
        for topic_partition, records in batches.items():
            key = partition_key(topic_partition)
            end = self._active.get(key, -1)
            for record in records:
                if record.offset < end:
                    token = KafkaToken(key, record.offset, 0, record)
                    deliveries.append(Delivery(to_message(record), token))
                    self.ledger.handed_out((key, record.offset))
        for key, end in list(self._active.items()):
            if client.position(TopicPartition(*key)) >= end:
                del self._active[key]
                client.pause(TopicPartition(*key))
        return deliveries


def _position(delivery: Delivery[KafkaToken]) -> tuple[PartitionKey, int]:
    token = delivery.token
    assert isinstance(token, KafkaToken)
    return (token.partition, token.offset)


def _by_key(offsets: Any) -> dict[PartitionKey, int]:
    return {partition_key(tp): int(offset) for tp, offset in offsets.items()}
