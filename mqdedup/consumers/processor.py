"""The one Processor: id → claim → handle → commit → settle, for every claim store.

Each module of the pipeline has one job: :mod:`~mqdedup.consumers.identity` takes
message ids and finds in-batch repeats; :mod:`~mqdedup.consumers.handling` calls the
handlers and checks their results; :mod:`~mqdedup.consumers.transactions` is the unit
of work of SQL claim stores (one database transaction, sessions from
:mod:`~mqdedup.consumers.sessions`) and :mod:`~mqdedup.consumers.leased` that of
leasing stores (Redis); :mod:`~mqdedup.consumers.careful` runs redelivered messages
carefully; :mod:`~mqdedup.consumers.dead_lettering` dead-letters and parks;
:mod:`~mqdedup.consumers.report` holds what a batch came to. Outages of the claim
store are waited out by :class:`mqdedup.outages.Outages`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from mqdedup.bridge import NotInBridgeError, call_hook, in_bridge
from mqdedup.consumers.careful import WORKER_DIED, CarefulRuns, RunsAlone
from mqdedup.consumers.dead_lettering import DeadLettering
from mqdedup.consumers.handling import Handlers
from mqdedup.consumers.identity import identify, resolve_repeats
from mqdedup.consumers.leased import LeasedRuns
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.report import BatchAbandonedError, BatchReport, Outcome
from mqdedup.consumers.sessions import SQLiteSelfDeadlockError
from mqdedup.consumers.transactions import TransactionalRuns
from mqdedup.db.dialects import is_transient
from mqdedup.dedup.claims import AttemptLog, ClaimStore
from mqdedup.errors import ConfigurationError, MessageError
from mqdedup.outages import Outages
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.consumers.base import Consumer
    from mqdedup.consumers.transport import Delivery, Transport

__all__ = [
    "WORKER_DIED",
    "BatchAbandonedError",
    "BatchReport",
    "Processor",
    "SQLiteSelfDeadlockError",
]

log = logging.getLogger(__name__)


class _Runs(RunsAlone, Protocol):
    """A claim store's unit of work, as the Processor drives it."""

    def first(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> list[tuple[Delivery[Any], Exception]]: ...

    def again(self, delivery: Delivery[Any]) -> Outcome: ...


class Processor:
    """Runs batches of deliveries for one consumer over one transport.

    For each batch: take message ids (no id → dead-letter), drop in-batch repeats,
    claim the ids in the consumer's claim store (``consumer.dedup``), run the handler
    for the new ones and store their results; retry failed messages up to the retry
    policy; dead-letter those that keep failing; finally settle every finished delivery.
    Outages of the claim store are waited out with backoff and never dead-letter
    anything.

    With the SQL store (the default) the claim, the handlers' writes and the results
    commit in ONE transaction per batch (``failure_isolation = "transaction"``: one per
    message, the broker still settled once for the batch, after the last commit). With
    a leasing store (``RedisDedup``) there is no transaction: each completion is
    written right after its handler. Either way a delivery is settled only after its
    claim and result are durable, or it was a duplicate, or it was dead-lettered.

    ``sessions`` may be None for a consumer whose claim store needs no database.
    """

    def __init__(
        self,
        consumer: Consumer,
        sessions: sessionmaker[Session] | None,
        transport: Transport[Any],
        *,
        metrics: Metrics | None = None,
        stop: StopToken | None = None,
        store: ClaimStore | None = None,
    ) -> None:
        consumer.validate()
        self.consumer = consumer
        self.transport = transport
        self.metrics = metrics or Metrics()
        self.stop = stop or StopToken()
        self.name = consumer.consumer_name
        self.policy = consumer.retry_policy
        self.store: ClaimStore = store or consumer.dedup.create_store(
            consumer.table_prefix, sessions
        )
        self.handlers = Handlers(consumer, self.metrics)
        #: When the last claim became durable (for the commit -> settle histogram).
        self.last_commit: float | None = None
        self.outages = self._outages(self.store.is_transient, self.store.infrastructure)
        database_outages = (
            self.outages if self.store.transactional else self._outages(is_transient, "database")
        )
        self.letters = DeadLettering(consumer, transport, self.metrics, sessions, database_outages)
        self.runs: _Runs
        if self.store.transactional:
            if sessions is None:
                raise ConfigurationError(
                    f"{type(consumer).__name__} keeps its claims in the database: it needs "
                    "a database engine or session factory"
                )
            self.runs = TransactionalRuns(self, sessions)
        else:
            self.runs = LeasedRuns(self)
        self.careful: CarefulRuns | None = None
        if isinstance(self.store, AttemptLog):
            self.careful = CarefulRuns(self, self.runs, self.store)

    def _outages(self, check: Callable[[BaseException], bool], what: str) -> Outages:
        return Outages(
            stop=self.stop,
            is_transient=check,
            what=what,
            backoff_max=self.policy.infrastructure_backoff_max,
            keepalive=self.transport.keepalive,
            on_retry=self._count_outage_retry,
            on_change=self._flag_outage,
            stopped=BatchAbandonedError,
            context={"consumer": self.name},
        )

    # -- public ------------------------------------------------------------------------

    def process(self, deliveries: Sequence[Delivery[Any]]) -> BatchReport:
        """Process and settle one batch; returns where each delivery ended."""
        if self.consumer.asynchronous and not in_bridge():  # before any handler runs
            raise NotInBridgeError(
                f"{type(self.consumer).__name__} is an AsyncConsumer: run it with "
                "`await consumer.run_async(engine)` or Worker(...).run(), which run the "
                "Processor on an event loop"
            )
        started = time.monotonic()
        self.metrics.delivered += len(deliveries)
        report = BatchReport()
        unique, repeats = identify(self.consumer, deliveries, report, self.letters.record)
        if unique:
            try:
                if self.careful is not None and any(d.message.redelivered for d in unique):
                    unique = self.careful.run(unique, report)
                failures = self.runs.first(unique, report) if unique else []
                for delivery, error in failures:
                    self._retry(delivery, error, report)
            except BatchAbandonedError:
                self._settle_committed(report)
                raise
        resolve_repeats(self.consumer, repeats, report, self.metrics)
        self.letters.send(report)
        if report.settled:
            self.transport.settle(report.settled)
            if self.last_commit is not None:
                self.metrics.histograms.observe(
                    "settle_seconds", time.monotonic() - self.last_commit
                )
                self.last_commit = None
        self.metrics.batches += 1
        self.metrics.dead_lettered += len(report.dead_lettered)
        self.metrics.batch_seconds += time.monotonic() - started
        return report

    # -- what the units of work call back ----------------------------------------------

    def committed(self, outcome: Outcome, report: BatchReport) -> None:
        """After a unit of work is durable: the after-commit hook, duplicate callbacks."""
        report.processed.extend(outcome.processed)
        report.duplicates.extend(outcome.duplicates)
        report.unsettled.extend(outcome.unsettled)
        report.results.update(outcome.stored_results)
        report.results.update(outcome.results)
        self.metrics.processed += len(outcome.processed)
        self.metrics.duplicates += len(outcome.duplicates)
        # call_hook: an async consumer's hooks are coroutines, awaited in the bridge.
        if outcome.processed:
            call_hook(self.consumer.after_commit, [d.message for d in outcome.processed])
        if self.consumer.wants_duplicate_results:
            for delivery in outcome.duplicates:
                call_hook(
                    self.consumer.on_duplicate,
                    delivery.message,
                    outcome.stored_results.get(str(delivery.message.id)),
                )

    def log_failure(self, delivery: Delivery[Any] | None, error: Exception) -> None:
        """One line per failed handler call."""
        log.info(
            "handler failed",
            extra={
                "consumer": self.name,
                "message_id": delivery.message.id if delivery else None,
                "error": f"{type(error).__name__}: {error}",
            },
        )

    # -- steps -------------------------------------------------------------------------

    def _retry(self, delivery: Delivery[Any], error: Exception, report: BatchReport) -> None:
        """Rerun one failed message on its own until done or out of attempts."""
        message_id = str(delivery.message.id)
        attempts = 1
        while True:
            if isinstance(error, MessageError):
                report.dead_lettered.append((delivery, self.letters.record(error, attempts)))
                return
            text = f"{type(error).__name__}: {error}"
            attempts = self.outages.run(
                functools.partial(self.store.record_failure, self.name, message_id, text)
            )
            self.metrics.failures += 1
            if attempts >= self.policy.max_attempts:
                report.dead_lettered.append((delivery, self.letters.record(error, attempts)))
                return
            if not self.outages.pause(self.policy.backoff(attempts)):
                report.unsettled.append(delivery)  # stopping: leave it to the next owner
                return
            self.metrics.retries += 1
            outcome = self.runs.again(delivery)
            if not outcome.failures:
                self.committed(outcome, report)
                return
            error = outcome.failures[0][1]

    def _settle_committed(self, report: BatchReport) -> None:
        """Abandoning a batch: still settle what has committed (fewer redeliveries)."""
        committed = report.processed + report.duplicates
        if committed:
            self.transport.settle(committed)

    def _count_outage_retry(self) -> None:
        self.metrics.database_retries += 1

    def _flag_outage(self, cause: str | None) -> None:
        self.metrics.outage = cause
