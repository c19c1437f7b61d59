"""The one Processor: id → claim → handle → commit → settle, for every claim store.

Each step has one module: :mod:`~mqdedup.consumers.identity` takes message ids and
finds in-batch repeats; :mod:`~mqdedup.consumers.handling` calls the handlers and checks
their results; a unit of work runs them against the claim store and returns an
:class:`~mqdedup.consumers.report.WorkOutcome` (:mod:`~mqdedup.consumers.transactions`: one
database transaction per batch or per message; :mod:`~mqdedup.consumers.leased`: Redis
leases); :mod:`~mqdedup.consumers.dead_lettering` dead-letters and parks. The Processor
does the bookkeeping: outcomes into the report, hooks, retries, careful mode, settling.
Outages of the claim store are waited out by :class:`mqdedup.outages.Outages`; an error
of a batch or a message that looks like one is first checked with a probe on a fresh
connection (:mod:`mqdedup.db.probe`): a database that answers makes it the messages'
(a batch then runs its messages one by one; a message's failure counts toward its
attempts, with a reason naming the limit it hit).

Careful mode: a redelivered message may be the one whose handler killed the previous
worker (``os._exit``, OOM, a segfault): nothing could record that attempt. So each
redelivered message that is not a duplicate gets its attempt counted and committed
*before* its handler runs, then runs alone. A process-killer thus reaches
``max_attempts`` and is dead-lettered without running again, and its batch-mates are
processed around it. Committed duplicates (the common redelivery, after a crash between
commit and settle) are found with one read for the whole batch and cost nothing more.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from mqdedup.bridge import NotInBridgeError, call_hook_protected, in_bridge
from mqdedup.consumers.dead_lettering import DeadLettering
from mqdedup.consumers.handling import Handlers
from mqdedup.consumers.identity import identify, resolve_repeats
from mqdedup.consumers.leased import LeasedRuns
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.positions import PositionFencedError, Positions
from mqdedup.consumers.report import BatchAbandonedError, BatchReport, WorkOutcome
from mqdedup.consumers.transactions import SQLiteSelfDeadlockError, TransactionalRuns
from mqdedup.consumers.transport import DeadLetter
from mqdedup.db.dialects import (
    is_contention,
    is_pool_timeout,
    is_pooler_queue_timeout,
    is_transient,
)
from mqdedup.db.probe import (
    Probe,
    check_pool_for_steps,
    engine_of,
    explain,
)
from mqdedup.dedup.claims import AttemptLog, ClaimStore
from mqdedup.errors import ConfigurationError, MessageError
from mqdedup.outages import NotAnOutageError, Outages
from mqdedup.stopping import StopToken, StopWhileWaiting

if TYPE_CHECKING:
    from mqdedup.consumers.spec import ConsumerSpec
    from mqdedup.consumers.transport import Delivery, Transport

__all__ = [
    "WORKER_DIED",
    "BatchAbandonedError",
    "BatchReport",
    "Processor",
    "SQLiteSelfDeadlockError",
]

log = logging.getLogger(__name__)

#: The last error of an attempt counted before its handler ran, until it finishes; the
#: dead-letter reason when the attempts ran out that way (the process died each time).
WORKER_DIED = "the worker died while handling it"


class _Lease(Protocol):
    """A unit of work held for a run of single messages."""

    def unit(self) -> Any:
        """The ``unit`` argument of the claim store (a session, a worker id)."""
        ...

    def close(self) -> None:
        """Give it back."""
        ...


class _Runs(Protocol):
    """A claim store's unit of work, as the Processor drives it."""

    def batch(self, deliveries: Sequence[Delivery[Any]]) -> WorkOutcome:
        """Run a batch (one transaction, one claim round); failures in the outcome."""
        ...

    def one(self, delivery: Delivery[Any], lease: Any = None) -> WorkOutcome:
        """Run one message on its own (on ``lease`` if given)."""
        ...

    def lease(self) -> _Lease:
        """A unit of work for a run of single messages."""
        ...


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
        consumer: ConsumerSpec,
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
        handlers = Handlers(consumer, self.metrics)
        #: When the last claim became durable (for the commit -> settle histogram).
        self.last_commit: float | None = None
        #: Asks the database whether it answers, once an error of a message's unit of
        #: work looked like an outage (SQL claim stores on an engine only).
        engine = engine_of(sessions.kw.get("bind")) if sessions is not None else None
        self.probe = Probe(engine) if engine is not None and self.store.transactional else None
        if self.probe is not None:
            check_pool_for_steps(
                self.probe.engine, type(consumer).__name__, consumer.uses_steps, self.name
            )
        self.outages = self._outages(self.store.is_transient, self.store.infrastructure)
        database_outages = (
            self.outages if self.store.transactional else self._outages(is_transient, "database")
        )
        self.letters = DeadLettering(consumer, transport, self.metrics, sessions, database_outages)
        self.runs: _Runs
        self.sessions = sessions
        #: Broker positions stored in the business transaction (a transport's option).
        self.positions: Positions | None = getattr(transport, "positions", None)
        self.claims = consumer.deduplicate
        if self.positions is not None and not self.store.transactional:
            raise ConfigurationError(
                f"{type(consumer).__name__} stores its offsets in the database: it needs "
                "the SQL claim store (dedup = SqlDedup())"
            )
        if self.store.transactional:
            if sessions is None:
                raise ConfigurationError(
                    f"{type(consumer).__name__} keeps its claims in the database: it needs "
                    "a database engine or session factory"
                )
            runs = TransactionalRuns(
                consumer, sessions, self.store, handlers, self.metrics, self.positions
            )
            self.claims = runs.claims
            self.runs = runs
        else:
            self.runs = LeasedRuns(self.name, self.store, handlers, self.metrics, self.outages)
        self.per_message = self.store.transactional and consumer.failure_isolation == "transaction"
        self.attempts = self.store if isinstance(self.store, AttemptLog) else None

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
            answers=self._answers,
            cause=self._cause,
        )

    @staticmethod
    def _cause(error: BaseException) -> str | None:
        """The log line's subject for an error that is no database outage."""
        if is_pool_timeout(error):
            return "the database pool gave no connection within its timeout (pool exhausted)"
        if is_pooler_queue_timeout(error):
            return (
                "the pooler gave no server connection within its query_wait_timeout "
                "(PgBouncer's default_pool_size too small; the database answers)"
            )
        return None

    def _answers(self, error: BaseException) -> bool:
        """Whether the database answers although ``error`` looked like an outage."""
        if self.probe is None or is_contention(error):
            return False
        if is_pool_timeout(error) or is_pooler_queue_timeout(error):
            self._short_of_connections(error)
        return self.probe.answers()

    def _short_of_connections(self, error: BaseException) -> None:
        """A pool (SQLAlchemy's, or a pooler's) gave no connection: counted, and the
        worker is not ready until a unit of work commits again."""
        self.metrics.pool_timeouts += 1
        self.metrics.connection_shortage = type(error).__name__

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
        if self.positions is not None:
            deliveries = self._positioned(self.positions, deliveries, report)
        unique, repeats = identify(self.consumer, deliveries, report, self.letters.record)
        if unique:
            try:
                if self.attempts is not None and any(d.message.redelivered for d in unique):
                    unique = self._careful(self.attempts, unique, report)
                if unique:
                    self._first(unique, report)
            except (BatchAbandonedError, StopWhileWaiting):  # a stop during a wait
                self._settle_committed(report)
                raise
        resolve_repeats(self.consumer, repeats, report, self.metrics)
        self.letters.send(report)
        if self.positions is not None and report.settled:
            self._advance(self.positions, report)
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

    # -- steps -------------------------------------------------------------------------

    def _first(self, deliveries: Sequence[Delivery[Any]], report: BatchReport) -> None:
        """The first run of a batch: one unit of work, or one per message (transaction
        mode, stopping between messages on request); then the retries of the failures."""
        failures: list[tuple[Delivery[Any], Exception]] = []
        if self.per_message:
            lease = self.runs.lease()
            try:
                for index, delivery in enumerate(deliveries):
                    if self.stop.requested:
                        report.unsettled.extend(deliveries[index:])
                        break
                    outcome = self._one(delivery, lease)
                    self._committed(outcome, report)
                    failures.extend(outcome.failures)
            finally:
                lease.close()
        else:
            try:
                outcome = self.outages.run(
                    functools.partial(self.runs.batch, deliveries), blame=True
                )
            except PositionFencedError:
                self._fenced(deliveries, report)
                return
            except NotAnOutageError as answered:
                self._each_alone(deliveries, answered, report, failures)
            else:
                self._committed(outcome, report)
                failures = outcome.failures
        for delivery, error in failures:
            self._retry(delivery, error, report)

    def _each_alone(
        self,
        deliveries: Sequence[Delivery[Any]],
        answered: NotAnOutageError,
        report: BatchReport,
        failures: list[tuple[Delivery[Any], Exception]],
    ) -> None:
        """A batch failed twice with an error that looked like an outage while the
        database answered: each message on its own, to find whose error it is."""
        if len(deliveries) == 1:
            failures.extend(self._not_an_outage(deliveries[0], answered).failures)
            return
        log.warning(
            "the database answers a probe: the batch's error is not an outage; running "
            "its messages one by one",
            extra={"consumer": self.name, "error": type(answered.error).__name__},
        )
        for index, delivery in enumerate(deliveries):
            if self.stop.requested:
                report.unsettled.extend(deliveries[index:])
                return
            outcome = self._one(delivery, again=False)
            self._committed(outcome, report)
            failures.extend(outcome.failures)

    def _one(
        self, delivery: Delivery[Any], lease: Any = None, *, again: bool = True
    ) -> WorkOutcome:
        """One message in a unit of work of its own; an error that looks like an outage
        while the database answers is the message's failure (see :class:`Outages`)."""
        try:
            return self.outages.run(
                functools.partial(self.runs.one, delivery, lease), blame=True, again=again
            )
        except PositionFencedError:
            assert self.positions is not None
            self.positions.fenced([delivery])
            return WorkOutcome(unsettled=[delivery])
        except NotAnOutageError as answered:
            return self._not_an_outage(delivery, answered)

    def _not_an_outage(self, delivery: Delivery[Any], answered: NotAnOutageError) -> WorkOutcome:
        """The message's failure, in words naming the limit it hit; one log line."""
        error = explain(answered.error, self.probe, answered=True) or answered.error
        short = is_pool_timeout(answered.error) or is_pooler_queue_timeout(answered.error)
        log.log(
            logging.ERROR if short else logging.WARNING,
            f"not an outage: {error}",
            extra={"consumer": self.name, "message_id": delivery.message.id},
        )
        return WorkOutcome(failures=[(delivery, error)])

    def _committed(self, outcome: WorkOutcome, report: BatchReport) -> None:
        """After a unit of work is durable: the report, the after-commit hook, duplicate
        callbacks. A hook that raises is logged; what committed stays committed."""
        report.processed.extend(outcome.processed)
        report.duplicates.extend(outcome.duplicates)
        report.unsettled.extend(outcome.unsettled)
        report.results.update(outcome.stored_results)
        report.results.update(outcome.results)
        self.metrics.processed += len(outcome.processed)
        self.metrics.duplicates += len(outcome.duplicates)
        if outcome.durable_at is not None:
            self.last_commit = outcome.durable_at
            if outcome.processed:  # a unit of work got its connections again
                self.metrics.connection_shortage = None
        # call_hook: an async consumer's hooks are coroutines, awaited in the bridge.
        if outcome.processed:
            self._hook(self.consumer.after_commit, [d.message for d in outcome.processed])
        if self.consumer.wants_duplicate_results:
            for delivery in outcome.duplicates:
                self._hook(
                    self.consumer.on_duplicate,
                    delivery.message,
                    outcome.stored_results.get(str(delivery.message.id)),
                )

    def _hook(self, hook: Callable[..., object], *args: Any) -> None:
        call_hook_protected(hook, *args, consumer=self.name, after="the commit")

    def _retry(self, delivery: Delivery[Any], error: Exception, report: BatchReport) -> None:
        """Rerun one failed message on its own until done or out of attempts."""
        message_id = str(delivery.message.id)
        attempts = 1
        while True:
            error = self._clear(error)
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
            outcome = self._one(delivery, again=False)
            if not outcome.failures:
                self._committed(outcome, report)
                return
            error = outcome.failures[0][1]

    # -- stored positions --------------------------------------------------------------

    def _positioned(
        self, positions: Positions, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> Sequence[Delivery[Any]]:
        """Deliveries below their stored positions are duplicates without a claim; those
        of partitions seeking back to their stored position come again."""
        assert self.sessions is not None
        done, again = self.outages.run(functools.partial(positions.done, self.sessions, deliveries))
        if not (done or again):
            return deliveries
        report.duplicates.extend(done)
        report.unsettled.extend(again)
        self.metrics.duplicates += len(done)
        skipped = {id(delivery) for delivery in (*done, *again)}
        return [delivery for delivery in deliveries if id(delivery) not in skipped]

    def _advance(self, positions: Positions, report: BatchReport) -> None:
        """Store the positions past deliveries settled without a transaction of theirs
        (dead letters, in-batch repeats): one small transaction, before the settle."""
        assert self.sessions is not None
        sessions = self.sessions
        done, again = self.outages.run(functools.partial(positions.done, sessions, report.settled))
        known = {id(delivery) for delivery in (*done, *again)}
        rest = [delivery for delivery in report.settled if id(delivery) not in known]
        if not rest:
            return

        def advance() -> None:
            with sessions() as session:
                with session.begin():
                    committed = positions.write(session, rest)
                committed()

        try:
            self.outages.run(advance)
        except PositionFencedError:
            positions.fenced(rest)  # the next owner settles them again (at least once)

    def _fenced(self, deliveries: Sequence[Delivery[Any]], report: BatchReport) -> None:
        """A late commit was fenced: nothing of it committed; the batch goes back."""
        assert self.positions is not None
        self.positions.fenced(deliveries)
        report.unsettled.extend(deliveries)

    # -- careful mode ------------------------------------------------------------------

    def _careful(
        self, attempt_log: AttemptLog, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> list[Delivery[Any]]:
        """Process the redelivered deliveries one at a time; return the others."""
        careful = [d for d in deliveries if d.message.redelivered]
        others = [d for d in deliveries if not d.message.redelivered]
        fresh = self._skip_processed(attempt_log, careful, report)
        lease = self.runs.lease()
        try:
            for index, delivery in enumerate(fresh):
                if self.stop.requested:
                    report.unsettled.extend(fresh[index:])
                    report.unsettled.extend(others)
                    return []
                self._careful_one(attempt_log, delivery, lease, report)
        finally:
            lease.close()
        return others

    def _skip_processed(
        self, attempt_log: AttemptLog, deliveries: list[Delivery[Any]], report: BatchReport
    ) -> list[Delivery[Any]]:
        """Settle the deliveries whose claims are committed; return the rest (one read)."""
        if not self.claims or not deliveries:
            return deliveries
        ids = [str(d.message.id) for d in deliveries]
        done = self.outages.run(functools.partial(attempt_log.processed, self.name, ids))
        if not done:
            return deliveries
        duplicates = [d for d in deliveries if d.message.id in done]
        stored = {key: value for key, value in done.items() if value is not None}
        self._committed(WorkOutcome(duplicates=duplicates, stored_results=stored), report)
        return [d for d in deliveries if d.message.id not in done]

    def _careful_one(
        self, attempt_log: AttemptLog, delivery: Delivery[Any], lease: _Lease, report: BatchReport
    ) -> None:
        """Count the attempt first, then run the message alone; retry up to the policy."""
        message_id = str(delivery.message.id)
        outages = self.outages
        while True:
            attempts, last_error, started = outages.run(
                functools.partial(self._start_attempt, attempt_log, message_id, lease)
            )
            if not started:
                record = self._exhausted_record(attempts, last_error)
                report.dead_lettered.append((delivery, record))
                log.warning(
                    "redelivered message has no attempts left; dead-lettering it unrun",
                    extra={
                        "consumer": self.name,
                        "message_id": message_id,
                        "reason": record.reason,
                    },
                )
                return
            outcome = self._one(delivery, lease)
            self._committed(outcome, report)
            if outcome.duplicates or outcome.unsettled:
                # Nothing of this attempt stands: claimed meanwhile by another worker, or
                # rolled back and given back (its partition's offset row fenced by a new
                # owner). Only a run that failed, or a worker that died, uses an attempt.
                outages.run(functools.partial(attempt_log.undo_attempt, self.name, message_id))
            if not outcome.failures:
                return
            error = self._clear(outcome.failures[0][1])
            outages.run(
                functools.partial(
                    attempt_log.finish_attempt,
                    self.name,
                    message_id,
                    f"{type(error).__name__}: {error}",
                )
            )
            self.metrics.failures += 1
            if isinstance(error, MessageError) or attempts >= self.policy.max_attempts:
                report.dead_lettered.append((delivery, self.letters.record(error, attempts)))
                return
            if not outages.pause(self.policy.backoff(attempts)):
                report.unsettled.append(delivery)  # stopping: leave it to the next owner
                return
            self.metrics.retries += 1

    def _start_attempt(
        self, attempt_log: AttemptLog, message_id: str, lease: _Lease
    ) -> tuple[int, str | None, bool]:
        unit = lease.unit()
        try:
            return attempt_log.start_attempt(
                unit, self.name, message_id, WORKER_DIED, self.policy.max_attempts
            )
        except BaseException:
            lease.close()
            raise

    def _exhausted_record(self, attempts: int, last_error: str | None) -> DeadLetter:
        """The dead letter of a message whose attempts were used up before it ran again."""
        if last_error is None or last_error == WORKER_DIED:
            reason = WORKER_DIED
        else:
            reason = f"handler failed after {attempts} attempts: {last_error}"
        return DeadLetter(
            reason=reason,
            consumer=self.name,
            attempts=attempts,
            error_message=last_error,
        )

    # -- bookkeeping -------------------------------------------------------------------

    def _settle_committed(self, report: BatchReport) -> None:
        """Abandoning a batch: still settle what has committed (fewer redeliveries)."""
        committed = report.processed + report.duplicates
        if committed:
            self.transport.settle(committed)

    def _clear(self, error: Exception) -> Exception:
        """A message's database error in words that name the limit it hit (a driver's
        parameter limit, a pool its handler exhausted), else ``error`` itself."""
        clear = explain(error, self.probe, answered=False)
        return error if clear is None else clear

    def _count_outage_retry(self) -> None:
        self.metrics.database_retries += 1

    def _flag_outage(self, cause: str | None) -> None:
        self.metrics.outage = cause
