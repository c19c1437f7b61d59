"""Replay: run a Kafka consumer again over a past range of its topics.

The replay assigns explicit partitions (it never joins the consumer group and commits
nothing), seeks each to the start of the range (an offset, or a timestamp through
``offsets_for_times``) and stops at the end of the range (an offset or a timestamp,
exclusive; default: the end offsets when the replay starts). Messages go through the
normal processor, so ids already claimed by the consumer are duplicates and nothing
happens twice. A dry run only reads the ids and counts what *would* happen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import Processor
from mqdedup.consumers.replay import ReplayReport, ReplayTally
from mqdedup.consumers.transport import Delivery
from mqdedup.db.engine import session_factory
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.kafka.client import KafkaClient
from mqdedup.kafka.offsets import PartitionKey
from mqdedup.kafka.records import KafkaToken
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.kafka.consumer import KafkaConsumer

log = logging.getLogger(__name__)


class KafkaReplay:
    """One replay run; see :meth:`mqdedup.kafka.consumer.KafkaConsumer.replay`."""

    def __init__(
        self,
        consumer: KafkaConsumer,
        database: Engine | sessionmaker[Session],
        *,
        start: int | datetime | None = None,
        end: int | datetime | None = None,
        partitions: Sequence[int] | None = None,
        topics: Sequence[str] | None = None,
        dry_run: bool = False,
        stop: StopToken | None = None,
        idle_timeout: float = 60.0,
    ) -> None:
        self.consumer = consumer
        self.settings = consumer.kafka_settings()
        self.sessions = session_factory(database) if isinstance(database, Engine) else database
        self.topics = list(topics or self.settings.topics)
        if not self.topics:
            raise ConfigurationError(
                f"replay of {type(consumer).__name__} needs topics=[...] "
                "(it subscribes by topic_pattern)"
            )
        self.partitions = list(partitions) if partitions is not None else None
        self.start = start
        self.end = end
        self.dry_run = dry_run
        self.stop = stop or StopToken()
        self.idle_timeout = idle_timeout
        self.metrics = Metrics()
        self.report = ReplayReport(dry_run=dry_run)
        self.tally = ReplayTally(consumer, self.sessions, self.report)

    def run(self) -> ReplayReport:
        """Replay the range and return the counts."""
        transport = KafkaClient(self.settings, metrics=self.metrics, group=False)
        try:
            transport.open()
            keys = self.partitions_to_replay(transport)
            transport.assign(keys)
            starts, ends = self.offset_range(transport, keys)
            active: dict[PartitionKey, int] = {}
            for key in keys:
                self.report.ranges[f"{key[0]}/{key[1]}"] = (starts[key], ends[key])
                if starts[key] < ends[key]:
                    transport.seek(key, starts[key])
                    active[key] = ends[key]
            log.info(
                "replay started",
                extra={
                    "consumer": self.settings.consumer_name,
                    "dry_run": self.dry_run,
                    "ranges": self.report.ranges,
                },
            )
            self._consume(transport, active)
        finally:
            transport.close(commit=False)
        log.info(
            "replay finished",
            extra={
                "consumer": self.settings.consumer_name,
                "dry_run": self.dry_run,
                "new": self.report.new,
                "duplicates": self.report.duplicates,
                "without_id": self.report.without_id,
                "dead_lettered": self.report.dead_lettered,
            },
        )
        return self.report

    # -- range ---------------------------------------------------------------------------

    def partitions_to_replay(self, transport: KafkaClient) -> list[PartitionKey]:
        """The (topic, partition) pairs this replay reads; unknown partitions are refused."""
        keys: list[PartitionKey] = []
        for topic in self.topics:
            existing = transport.partitions_of(topic)
            chosen = existing if self.partitions is None else self.partitions
            missing = sorted(set(chosen) - set(existing))
            if missing:
                raise ConfigurationError(
                    f"Kafka topic {topic!r} has no partition(s) {missing} (it has {len(existing)})"
                )
            keys.extend((topic, p) for p in sorted(set(chosen)))
        return keys

    def offset_range(
        self, transport: KafkaClient, keys: list[PartitionKey]
    ) -> tuple[dict[PartitionKey, int], dict[PartitionKey, int]]:
        """Per partition: the first offset to replay and the end (exclusive), clamped to
        what the log still holds."""
        first = transport.beginning_offsets(keys)
        last = transport.end_offsets(keys)
        starts = self._resolve(transport, keys, self.start, default=first, beyond=last)
        ends = self._resolve(transport, keys, self.end, default=last, beyond=last)
        starts = {k: max(starts[k], first[k]) for k in keys}
        ends = {k: min(ends[k], last[k]) for k in keys}
        return starts, ends

    @staticmethod
    def _resolve(
        transport: KafkaClient,
        keys: list[PartitionKey],
        bound: int | datetime | None,
        *,
        default: dict[PartitionKey, int],
        beyond: dict[PartitionKey, int],
    ) -> dict[PartitionKey, int]:
        if bound is None:
            return dict(default)
        if isinstance(bound, datetime):
            if bound.tzinfo is None:
                raise ConfigurationError("replay timestamps must be timezone-aware")
            found = transport.offsets_for_times(keys, bound)
            return {k: beyond[k] if found.get(k) is None else int(found[k] or 0) for k in keys}
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ConfigurationError(f"replay offsets must be non-negative integers, not {bound!r}")
        return dict.fromkeys(keys, bound)

    # -- the loop ------------------------------------------------------------------------

    def _consume(self, transport: KafkaClient, active: dict[PartitionKey, int]) -> None:
        processor = (
            None
            if self.dry_run
            else Processor(
                self.consumer, self.sessions, transport, metrics=self.metrics, stop=self.stop
            )
        )
        batch_size = self.consumer.batch_size
        last_progress = time.monotonic()
        while active and not self.stop.requested:
            deliveries = transport.poll(batch_size, self.consumer.poll_timeout)
            in_range = [d for d in deliveries if _offset(d) < active.get(_key(d), -1)]
            if in_range:
                last_progress = time.monotonic()
                if processor is None:
                    self.tally.dry(in_range)
                else:
                    self.tally.processed(processor.process(in_range))
            for key in list(active):
                if transport.position(key) >= active[key]:
                    del active[key]
            if active and time.monotonic() - last_progress > self.idle_timeout:
                raise BrokerUnavailableError(
                    f"replay made no progress for {self.idle_timeout:.0f} s "
                    f"(partitions left: {sorted(active)})"
                )


def _key(delivery: Delivery[Any]) -> PartitionKey:
    token: Any = delivery.token
    assert isinstance(token, KafkaToken)
    return token.partition


def _offset(delivery: Delivery[Any]) -> int:
    token: Any = delivery.token
    assert isinstance(token, KafkaToken)
    return token.offset
