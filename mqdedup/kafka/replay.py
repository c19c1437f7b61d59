"""Replay: run a Kafka consumer again over a past range of its topics.

A replay is a transport over a range (:class:`~mqdedup.kafka.range.KafkaRangeTransport`:
explicit partitions, no group membership, nothing committed) run by the same Worker and
Processor as live traffic (:class:`~mqdedup.consumers.replay.ReplayRun`): ids already
claimed by the consumer are duplicates and nothing happens twice; failing messages go
to the consumer's dead-letter topic with their reason. A dry run only reads the ids and
counts what *would* happen.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.replay import ReplayReport, ReplayRun
from mqdedup.consumers.spec import ConsumerSpec
from mqdedup.db.engine import session_factory
from mqdedup.errors import ConfigurationError
from mqdedup.kafka.offset_store import StoredOffsets
from mqdedup.kafka.range import KafkaRangeTransport
from mqdedup.kafka.settings import KafkaSettings
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)


class ReplayedConsumer(ConsumerSpec, Protocol):
    """What a replay reads of its consumer (a :class:`~mqdedup.kafka.consumer.KafkaConsumer`)."""

    def kafka_settings(self) -> KafkaSettings:
        """The consumer's resolved Kafka settings."""
        ...


class KafkaReplay:
    """One replay run; see :meth:`mqdedup.kafka.consumer.KafkaConsumer.replay`."""

    def __init__(
        self,
        consumer: ReplayedConsumer,
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
        self.dry_run = dry_run
        topics = list(topics or self.settings.topics)
        if not topics:
            raise ConfigurationError(
                f"replay of {type(consumer).__name__} needs topics=[...] "
                "(it subscribes by topic_pattern)"
            )
        self.transport = KafkaRangeTransport(
            self.settings,
            topics=topics,
            partitions=partitions,
            start=start,
            end=end,
            stop=stop,
            idle_timeout=idle_timeout,
        )
        if self.settings.offsets_in_database:
            # Records below the group's stored offsets are duplicates (no claims read).
            self.transport.positions = StoredOffsets(
                self.settings.group_id,
                prefix=self.settings.table_prefix,
                claims=self.settings.claims_with_offsets,
            )
        sessions = session_factory(database) if isinstance(database, Engine) else database
        self._run = ReplayRun(consumer, sessions, self.transport, dry_run=dry_run, stop=stop)

    @property
    def report(self) -> ReplayReport:
        """The counts so far (final once :meth:`run` returned)."""
        return self._run.report

    def open(self) -> None:
        """Connect and resolve the range (``transport.starts`` / ``ends``); idempotent."""
        self.transport.open()

    def close(self) -> None:
        """Disconnect (a replay that is not run, e.g. refused by a check)."""
        self.transport.close()

    def run(self) -> ReplayReport:
        """Replay the range and return the counts."""
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        name = self.settings.consumer_name
        log.info(
            "replay started",
            extra={"consumer": name, "dry_run": self.dry_run, "ranges": self.report.ranges},
        )
        report = self._run.run()
        log.info(
            "replay finished",
            extra={
                "consumer": name,
                "dry_run": self.dry_run,
                "new": report.new,
                "duplicates": report.duplicates,
                "without_id": report.without_id,
                "dead_lettered": report.dead_lettered,
            },
        )
        return report
