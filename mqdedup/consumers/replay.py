"""What every replay (Kafka range, RabbitMQ stream) counts, and how.

Broker-agnostic: the Kafka and RabbitMQ replays feed it batches; it turns processor
reports into counts, or, in a dry run, asks the dedup table which ids are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.base import Consumer
from mqdedup.consumers.processor import BatchReport
from mqdedup.consumers.transport import Delivery
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import MessageError

MISSING_ID_REASON = "missing message id"


@dataclass
class ReplayReport:
    """What a replay did (or, in a dry run, would do)."""

    dry_run: bool = False
    #: Messages whose effects were applied now (dry run: would be applied).
    new: int = 0
    #: Messages already processed before (or repeated within the range).
    duplicates: int = 0
    #: Messages without a message id (dead-lettered unless it is a dry run).
    without_id: int = 0
    #: Other messages dead-lettered (their handler kept failing).
    dead_lettered: int = 0
    #: Messages that could not be settled (their dead-letter publish failed).
    unsettled: int = 0
    #: ``topic/partition`` or stream -> ``(start offset, end offset)`` replayed.
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Messages read from the range."""
        return self.new + self.duplicates + self.without_id + self.dead_lettered + self.unsettled


class ReplayTally:
    """Adds batches to a :class:`ReplayReport`."""

    def __init__(
        self, consumer: Consumer, sessions: sessionmaker[Session], report: ReplayReport
    ) -> None:
        self.consumer = consumer
        self.sessions = sessions
        self.report = report
        self._seen: set[str] = set()

    def processed(self, batch: BatchReport) -> None:
        """Count what the processor did with a batch."""
        report = self.report
        report.new += len(batch.processed)
        report.duplicates += len(batch.duplicates)
        report.unsettled += len(batch.unsettled)
        for _delivery, record in batch.dead_lettered:
            if record.reason.startswith(MISSING_ID_REASON):
                report.without_id += 1
            else:
                report.dead_lettered += 1

    def dry(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Count what processing ``deliveries`` would do, writing nothing."""
        ids: list[str] = []
        for delivery in deliveries:
            try:
                ids.append(self.consumer.message_id(delivery.message))
            except MessageError:
                self.report.without_id += 1
        claimed = self._claimed(sorted(set(ids) - self._seen))
        for message_id in ids:
            if message_id in self._seen or message_id in claimed:
                self.report.duplicates += 1
            else:
                self.report.new += 1
            self._seen.add(message_id)

    def _claimed(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        table = DedupStore(self.consumer.table_prefix).schema.processed
        with self.sessions() as session:
            rows = session.execute(
                select(table.c.message_id).where(
                    table.c.consumer_name == self.consumer.consumer_name,
                    table.c.message_id.in_(ids),
                )
            )
            return {row[0] for row in rows}
