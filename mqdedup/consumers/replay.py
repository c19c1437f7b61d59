"""A replay: a transport over a past range, run by the same Worker and Processor.

Broker-agnostic. A broker's range transport (:class:`mqdedup.kafka.range.KafkaRangeTransport`,
:class:`mqdedup.rabbitmq.stream.StreamRangeTransport`) hands out the range's messages and
returns an empty fetch once the range is read; :class:`ReplayRun` runs it with the
:class:`~mqdedup.consumers.worker.Worker` like live traffic, so already claimed ids are
duplicates and nothing happens twice. The counts come from the Worker's
:class:`~mqdedup.consumers.metrics.Metrics` and the transport's :class:`RangeLedger`. A
dry run is the same Worker over the same transport with :class:`DryRun` in the
Processor's place: it only asks the dedup table which ids are known.

:class:`ParkedTransport` is the replay of the dead letters the broker refused and the
database kept (``mqdedup dead-letters replay``; see :mod:`mqdedup.dedup.dead_letters`):
a row is deleted when its message is settled (processed or a duplicate), and stays, with
the new reason, when it is dead-lettered again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.identity import message_id_of
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.report import BatchReport
from mqdedup.consumers.transport import DeadLetter, Delivery, Transport
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import MessageError
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.consumers.spec import ConsumerSpec

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


class RangeLedger:
    """What a range transport handed out, and how each delivery ended.

    ``position`` is whatever names one message of the range (``(topic, partition,
    offset)``, a stream offset). A delivery is *pending* from its fetch until it is
    settled; a dead letter's reason is noted when ``dead_letter`` is called, so its
    settle counts it as dead-lettered (without an id, or for another reason).
    """

    def __init__(self) -> None:
        #: ``topic/partition`` or stream -> ``(start offset, end offset)``.
        self.ranges: dict[str, tuple[int, int]] = {}
        self.settled = 0
        self.without_id = 0
        self.dead_lettered = 0
        self._pending: dict[Hashable, str | None] = {}

    def handed_out(self, position: Hashable) -> None:
        """A delivery left the transport (again, if it was given back: a dead-letter
        attempt that failed then is forgotten)."""
        self._pending[position] = None

    def dead_lettering(self, position: Hashable, reason: str) -> None:
        """The processor dead-letters this delivery (it is settled next, if that worked)."""
        self._pending[position] = reason

    def settle(self, position: Hashable) -> None:
        """The delivery is done: processed, a duplicate or dead-lettered."""
        if position not in self._pending:
            return
        reason = self._pending.pop(position)
        self.settled += 1
        if reason is None:
            return
        if reason.startswith(MISSING_ID_REASON):
            self.without_id += 1
        else:
            self.dead_lettered += 1

    @property
    def unsettled(self) -> int:
        """Deliveries handed out and not settled (yet)."""
        return len(self._pending)

    def note_offset(self, name: str, offset: int) -> None:
        """Widen ``name``'s range to include ``offset`` (for ranges known as they are read)."""
        first, last = self.ranges.get(name, (offset, offset))
        self.ranges[name] = (min(first, offset), max(last, offset + 1))


class RangeTransport(Transport[Any], Protocol):
    """A transport over a past range: its fetch blocks until it has deliveries or the
    range is read (then it returns ``[]``), and it keeps a :class:`RangeLedger`."""

    @property
    def ledger(self) -> RangeLedger:
        """The transport's counts."""
        ...

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Hand these unsettled deliveries out again."""
        ...


class ReplayRun:
    """Runs ``consumer`` over a range transport with the Worker, or tallies a dry run.

    :attr:`report` is live while :meth:`run` runs (for a progress bar).
    """

    def __init__(
        self,
        consumer: ConsumerSpec,
        sessions: sessionmaker[Session],
        transport: RangeTransport,
        *,
        dry_run: bool = False,
        stop: StopToken | None = None,
    ) -> None:
        self.consumer = consumer
        self.sessions = sessions
        self.transport = transport
        self.dry_run = dry_run
        self.stop = stop or StopToken()
        self.metrics = Metrics()
        self._dry = ReplayReport(dry_run=True)

    @property
    def report(self) -> ReplayReport:
        """The counts so far."""
        ledger = self.transport.ledger
        if self.dry_run:
            self._dry.ranges = dict(ledger.ranges)
            return self._dry
        return ReplayReport(
            new=self.metrics.processed,
            duplicates=self.metrics.duplicates,
            without_id=ledger.without_id,
            dead_lettered=ledger.dead_lettered,
            unsettled=ledger.unsettled,
            ranges=dict(ledger.ranges),
        )

    def run(self) -> ReplayReport:
        """Read the whole range (the transport is closed on the way out)."""
        if not self.dry_run:
            Worker(
                self.consumer, self.transport, self.sessions, stop=self.stop, metrics=self.metrics
            ).run(until_idle=True)
            return self.report
        dry_run = DryRun(ReplayTally(self.consumer, self.sessions, self._dry), self.transport)
        Worker(self.consumer, self.transport, self.sessions, stop=self.stop, processor=dry_run).run(
            until_idle=True
        )
        return self.report


class DryRun:
    """A dry run's stand-in for the Processor: count what processing would do, write
    nothing, and settle each batch so the range moves on."""

    def __init__(self, tally: ReplayTally, transport: Transport[Any]) -> None:
        self.tally = tally
        self.transport = transport

    def process(self, deliveries: Sequence[Delivery[Any]]) -> BatchReport:
        """Count ``deliveries`` and settle them (nothing was processed)."""
        self.tally.dry(deliveries)
        self.transport.settle(deliveries)
        return BatchReport()


class ReplayTally:
    """Counts what processing batches *would* do, writing nothing (a dry run)."""

    def __init__(
        self, consumer: ConsumerSpec, sessions: sessionmaker[Session], report: ReplayReport
    ) -> None:
        self.consumer = consumer
        self.sessions = sessions
        self.report = report
        self._seen: set[str] = set()

    def dry(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Count what processing ``deliveries`` would do, writing nothing."""
        ids: list[str] = []
        for delivery in deliveries:
            try:  # a strategy that raises is its message's fate (as in a run), not a crash
                ids.append(message_id_of(self.consumer, delivery))
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
        store = DedupStore(self.consumer.table_prefix)
        with self.sessions() as session:  # a read per batch, split under the parameter limit
            return set(store.processed(self.consumer.consumer_name, ids, session))


class ParkedTransport:
    """Hands out kept dead letters of one consumer once each, oldest first.

    ``token`` of each delivery is the row id. Settling deletes the rows (in their own
    short transaction, after the processor's commit); ``dead_letter`` leaves the row in
    place with the new reason, and the later ``settle`` of that delivery keeps it.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        consumer_name: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        ids: Sequence[int] | None = None,
    ) -> None:
        self.sessions = sessions
        self.consumer_name = consumer_name
        self.table = DeadLetterTable(prefix)
        self.ids = list(ids) if ids is not None else None
        self._after_id = 0
        self._kept_again: set[int] = set()
        self._again: list[Delivery[Any]] = []
        self.settled = 0
        self.dead_lettered_again = 0

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[Any]]:
        """The next ``max_messages`` kept dead letters (none left: an empty list)."""
        if self._again:
            batch, self._again = self._again[:max_messages], self._again[max_messages:]
            return batch
        with self.sessions() as session:
            rows = self.table.list(
                session,
                self.consumer_name,
                after_id=self._after_id,
                ids=self.ids,
                limit=max_messages,
            )
        if rows:
            self._after_id = rows[-1].id
        return [Delivery(row.message, row.id) for row in rows]

    def settle(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Delete the rows of messages that are done (not those dead-lettered again)."""
        done = [int(d.token) for d in deliveries if int(d.token) not in self._kept_again]
        if not done:
            return
        with self.sessions() as session, session.begin():
            self.settled += self.table.delete(session, done)

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Hand these unsettled rows out again, first (their rows are still there)."""
        again = [
            Delivery(dataclasses.replace(d.message, redelivered=True), d.token) for d in deliveries
        ]
        self._again = again + self._again

    def dead_letter(self, delivery: Delivery[Any], record: DeadLetter) -> None:
        """The message failed again: its row stays (the reason is logged by the worker)."""
        self._kept_again.add(int(delivery.token))
        self.dead_lettered_again += 1

    def keepalive(self) -> None:
        """Nothing to keep alive."""

    def close(self) -> None:
        """Nothing to release: rows not yet settled simply stay."""
