"""The processing core shared by every transport: dedup → handle → commit → settle."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker
from tenacity import Retrying, retry_if_exception, stop_never, wait_random_exponential

from mqdedup import tracing
from mqdedup.consumers.base import (
    BatchContext,
    Consumer,
    Context,
    InvalidResultError,
    guard_session,
    unguard_session,
)
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery, Transport
from mqdedup.db import sqlite_lock
from mqdedup.db.dialects import is_data_error, is_sqlite_lock_error, is_transient
from mqdedup.dedup.dead_letters import DeadLetterCause, DeadLetterTable, clean_text
from mqdedup.dedup.ids import InvalidMessageIdError, check_message_id
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import DeadLetterRefusedError, MessageError
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The last error of an attempt counted before its handler ran, until it finishes; the
#: dead-letter reason when the attempts ran out that way (the process died each time).
WORKER_DIED = "the worker died while handling it"


class BatchAbandonedError(Exception):
    """A stop was requested while the database was unreachable; nothing was settled."""


class SQLiteSelfDeadlockError(RuntimeError):
    """A handler waited for the SQLite write lock its own consumer transaction holds.

    SQLite allows one writer per database file. The processor's transaction takes the
    lock with the claim (mqdedup's engines with ``BEGIN IMMEDIATE``), so a handler that
    writes to the same file through another connection waits until its busy timeout and
    could never succeed. It fails that message instead of retrying the batch forever.
    """


@dataclass
class BatchReport:
    """Where each delivery of a batch ended."""

    processed: list[Delivery[Any]] = field(default_factory=list)
    duplicates: list[Delivery[Any]] = field(default_factory=list)
    dead_lettered: list[tuple[Delivery[Any], DeadLetter]] = field(default_factory=list)
    unsettled: list[Delivery[Any]] = field(default_factory=list)
    #: Handler results by message id: stored by this batch, or (when ``on_duplicate``
    #: is overridden) read back for its duplicates. Repeats inside the batch get them.
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def settled(self) -> list[Delivery[Any]]:
        """Deliveries handed to ``Transport.settle``."""
        return self.processed + self.duplicates + [d for d, _ in self.dead_lettered]


@dataclass
class _Pass:
    """What one transaction did."""

    processed: list[Delivery[Any]] = field(default_factory=list)
    duplicates: list[Delivery[Any]] = field(default_factory=list)
    failures: list[tuple[Delivery[Any], Exception]] = field(default_factory=list)
    stored_results: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)

    def add(self, other: _Pass) -> None:
        """Add what another (committed) transaction did."""
        self.processed.extend(other.processed)
        self.duplicates.extend(other.duplicates)
        self.failures.extend(other.failures)
        self.stored_results.update(other.stored_results)
        self.results.update(other.results)


class _SessionLease:
    """Transaction mode: one connection and one session for a batch's transactions.

    Checking a connection out of the pool and building a session for every message
    costs ~100 µs of CPU, a sizeable part of a one-message transaction. The session is
    bound to a connection held for the batch; each message still begins and commits
    its own transaction on it. Any error closes both (the next use starts afresh).
    """

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self._session: Session | None = None
        self._connection: Connection | None = None

    def session(self) -> Session:
        if self._session is None:
            bind = self._sessions.kw.get("bind")
            if isinstance(bind, Engine):
                self._connection = bind.connect()
                self._session = self._sessions(bind=self._connection)
            else:  # bound elsewhere (several engines, a connection): plain sessions
                self._session = self._sessions()
        return self._session

    def close(self) -> None:
        session, self._session = self._session, None
        connection, self._connection = self._connection, None
        try:
            if session is not None:
                session.close()
        finally:
            if connection is not None:
                connection.close()


class _RerunWithoutError(Exception):
    def __init__(self, delivery: Delivery[Any] | None, error: Exception) -> None:
        super().__init__(str(error))
        self.delivery = delivery  # None: the batch handler failed, rerun per message
        self.error = error


class Processor:
    """Runs batches of deliveries for one consumer over one transport.

    For each batch: take message ids (no id → dead-letter), drop in-batch repeats,
    then in ONE transaction claim the ids, run the handler for the new ones and store
    their results; commit; retry failed messages up to the retry policy; dead-letter
    those that keep failing; finally settle every finished delivery. Transient database
    errors retry the transaction with backoff and never dead-letter anything.

    With ``failure_isolation = "transaction"`` each message of the batch gets its own
    transaction instead (claim, handler, result, commit), one after the other; the
    broker is still settled once for the batch, after the last of those commits.
    """

    def __init__(
        self,
        consumer: Consumer,
        sessions: sessionmaker[Session],
        transport: Transport[Any],
        *,
        metrics: Metrics | None = None,
        stop: StopToken | None = None,
        store: DedupStore | None = None,
    ) -> None:
        consumer.validate()
        self.consumer = consumer
        self.sessions = sessions
        self.transport = transport
        self.metrics = metrics or Metrics()
        self.stop = stop or StopToken()
        self.store = store or DedupStore(consumer.table_prefix)
        self.dead_letters = DeadLetterTable(consumer.table_prefix)
        self.name = consumer.consumer_name
        self.policy = consumer.retry_policy
        self.per_message = consumer.failure_isolation == "transaction"
        #: When the last transaction committed (for the commit -> settle histogram).
        self._last_commit: float | None = None
        bind = sessions.kw.get("bind")
        self._sqlite = isinstance(bind, Engine) and bind.dialect.name == "sqlite"
        if self._sqlite:
            sqlite_lock.install()  # a handler's own connection to the file fails fast

    # -- public ------------------------------------------------------------------------

    def process(self, deliveries: Sequence[Delivery[Any]]) -> BatchReport:
        """Process and settle one batch; returns where each delivery ended."""
        started = time.monotonic()
        self.metrics.delivered += len(deliveries)
        report = BatchReport()
        unique, repeats = self._identify(deliveries, report)
        if unique:
            try:
                if any(d.message.redelivered for d in unique):
                    unique = self._run_carefully(unique, report)
                if not unique:
                    failures = []
                elif self.per_message:
                    failures = self._run_each(unique, report)
                else:
                    outcome = self._with_database_retry(lambda: self._run_pass(unique))
                    self._committed(outcome, report)
                    failures = outcome.failures
                for delivery, error in failures:
                    self._retry(delivery, error, report)
            except BatchAbandonedError:
                self._settle_committed(report)
                raise
        self._resolve_repeats(repeats, report)
        self._dead_letter(report)
        if report.settled:
            self.transport.settle(report.settled)
            if self._last_commit is not None:
                self.metrics.histograms.observe(
                    "settle_seconds", time.monotonic() - self._last_commit
                )
                self._last_commit = None
        self._count(report, started)
        return report

    # -- steps -------------------------------------------------------------------------

    def _identify(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> tuple[list[Delivery[Any]], list[tuple[Delivery[Any], str]]]:
        """Attach message ids; split off messages without one and in-batch repeats."""
        unique: list[Delivery[Any]] = []
        repeats: list[tuple[Delivery[Any], str]] = []
        seen: set[str] = set()
        for delivery in deliveries:
            try:
                message_id = self._message_id(delivery)
            except MessageError as error:
                report.dead_lettered.append((delivery, self._dead_letter_record(error, 1)))
                continue
            if message_id in seen:
                repeats.append((delivery, message_id))
                continue
            seen.add(message_id)
            unique.append(Delivery(delivery.message.with_id(message_id), delivery.token))
        return unique, repeats

    def _message_id(self, delivery: Delivery[Any]) -> str:
        """The delivery's message id, valid for every database, or a MessageError.

        Whatever the strategy raises belongs to this message (a user function failing
        on its body, say): it is dead-lettered with that reason, never a worker crash.
        """
        try:
            message_id = self.consumer.message_id(delivery.message)
        except MessageError:
            raise
        except Exception as error:
            raise InvalidMessageIdError(
                f"the message id strategy failed: {type(error).__name__}: {error}"
            ) from error
        return check_message_id(message_id, "the consumer's message id")

    def _run_each(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> list[tuple[Delivery[Any], Exception]]:
        """Transaction mode: one transaction per message, each committed on its own.

        Returns the failed deliveries (each rolled back alone) for :meth:`_retry`. On a
        stop request the rest of the batch is left unsettled for the next owner.
        """
        failures: list[tuple[Delivery[Any], Exception]] = []
        lease = _SessionLease(self.sessions)
        try:
            for index, delivery in enumerate(deliveries):
                if self.stop.requested:
                    report.unsettled.extend(deliveries[index:])
                    break
                outcome = self._with_database_retry(
                    functools.partial(self._own_transaction, delivery, lease)
                )
                self._committed(outcome, report)
                failures.extend(outcome.failures)
        finally:
            lease.close()
        return failures

    def _own_transaction(
        self, delivery: Delivery[Any], lease: _SessionLease | None = None
    ) -> _Pass:
        """One message in its own transaction; a handler failure rolls back only it."""
        if lease is None:
            with self.sessions() as session:
                return self._own_transaction_in(session, delivery)
        try:
            return self._own_transaction_in(lease.session(), delivery)
        except BaseException:
            lease.close()  # e.g. a dead connection: the retry starts on a fresh one
            raise

    def _own_transaction_in(self, session: Session, delivery: Delivery[Any]) -> _Pass:
        try:
            return self._transaction_in(session, [delivery], False, False)
        except _RerunWithoutError as failed:  # rolled back: its claim is gone too
            self._log_failure(delivery, failed.error)
            return _Pass(failures=[(delivery, failed.error)])
        except Exception as error:
            if is_transient(error) or not is_data_error(error):
                raise
            # Its own data, outside the handler (e.g. a deferred constraint at commit).
            self._log_failure(delivery, error)
            return _Pass(failures=[(delivery, error)])
        finally:
            session.expunge_all()  # the next message starts with an empty session

    def _run_pass(self, deliveries: Sequence[Delivery[Any]]) -> _Pass:
        """One transaction over ``deliveries``: claim, handle the new ones, commit.

        Without savepoints a handler failure rolls the transaction back; it is then run
        again without the failing message (``auto`` reruns with savepoints, so one more
        failure does not cost another rerun).
        """
        pending = list(deliveries)
        excluded: list[tuple[Delivery[Any], Exception]] = []
        use_batch_handler = self.consumer.has_batch_handler
        savepoints = self.consumer.failure_isolation == "savepoint"
        while pending:
            try:
                outcome = self._transaction(pending, use_batch_handler, savepoints)
            except _RerunWithoutError as rerun:
                if rerun.delivery is None:
                    use_batch_handler = False
                else:
                    pending.remove(rerun.delivery)
                    excluded.append((rerun.delivery, rerun.error))
                    self._log_failure(rerun.delivery, rerun.error)
                savepoints = self.consumer.failure_isolation == "auto" or savepoints
                continue
            except Exception as error:
                if is_transient(error) or not is_data_error(error):
                    raise
                return self._find_data_error(pending, excluded, error)
            outcome.failures.extend(excluded)
            return outcome
        return _Pass(failures=excluded)

    def _find_data_error(
        self,
        pending: list[Delivery[Any]],
        excluded: list[tuple[Delivery[Any], Exception]],
        error: Exception,
    ) -> _Pass:
        """A data error outside any handler's boundary: find the message it belongs to.

        Ids and results are validated before the database sees them, so this is the
        defensive path (e.g. a handler's write that breaks a deferred constraint at
        commit). The transaction has rolled back; each message then runs in its own, so
        the culprit fails alone (retry policy) and its batch-mates commit.
        """
        log.warning(
            "a data error outside the handlers; running the batch one message at a time",
            extra={"consumer": self.name, "error": f"{type(error).__name__}: {error}"},
        )
        if len(pending) == 1:
            self._log_failure(pending[0], error)
            return _Pass(failures=[*excluded, (pending[0], error)])
        outcome = _Pass(failures=list(excluded))
        for delivery in pending:
            outcome.add(self._run_pass([delivery]))
        return outcome

    def _transaction(
        self, deliveries: Sequence[Delivery[Any]], use_batch_handler: bool, savepoints: bool
    ) -> _Pass:
        with self.sessions() as session:
            return self._transaction_in(session, deliveries, use_batch_handler, savepoints)

    def _transaction_in(
        self,
        session: Session,
        deliveries: Sequence[Delivery[Any]],
        use_batch_handler: bool,
        savepoints: bool,
    ) -> _Pass:
        """Claim, handle and store results in one transaction of ``session``; commit."""
        outcome = _Pass()
        started = time.monotonic()
        with session.begin():
            ids = [d.message.id for d in deliveries if d.message.id is not None]
            if self.consumer.deduplicate:
                new_ids = self.store.claim(session, self.name, ids)
                self.metrics.histograms.observe("claim_seconds", time.monotonic() - started)
            else:
                new_ids = set(ids)
            new = [d for d in deliveries if d.message.id in new_ids]
            outcome.duplicates = [d for d in deliveries if d.message.id not in new_ids]
            if outcome.duplicates and self.consumer.wants_duplicate_results:
                outcome.stored_results = self.store.results(
                    session, self.name, [str(d.message.id) for d in outcome.duplicates]
                )
            guard_session(session)  # the handlers must not end this transaction
            if self._sqlite:
                sqlite_lock.enter(session)
            try:
                results = self._handle(session, new, outcome, use_batch_handler, savepoints)
            finally:
                unguard_session(session)
                if self._sqlite:
                    sqlite_lock.leave()
            outcome.results = results
            if outcome.failures and self.consumer.deduplicate:
                self.store.forget(
                    session, self.name, [str(d.message.id) for d, _ in outcome.failures]
                )
            if self.consumer.deduplicate:
                self.store.save_results(session, self.name, results)
        self._last_commit = time.monotonic()
        self.metrics.histograms.observe("transaction_seconds", self._last_commit - started)
        return outcome

    def _handle(
        self,
        session: Session,
        new: list[Delivery[Any]],
        outcome: _Pass,
        use_batch_handler: bool,
        savepoints: bool,
    ) -> dict[str, Any]:
        """Run the handlers; fill ``outcome.processed`` / ``failures``; return results."""
        results: dict[str, Any] = {}
        if use_batch_handler and new:
            batch_results = self._isolated(
                session, savepoints, None, lambda: self._call_batch_handler(session, new)
            )
            if not isinstance(batch_results, Exception):
                outcome.processed.extend(new)
                return batch_results
        for delivery in new:
            result = self._isolated(
                session,
                savepoints,
                delivery,
                functools.partial(self._call_handler, session, delivery),
            )
            if isinstance(result, Exception):
                outcome.failures.append((delivery, result))
                continue
            outcome.processed.append(delivery)
            if result is not None:
                results[str(delivery.message.id)] = result
        return results

    def _isolated(
        self,
        session: Session,
        savepoints: bool,
        delivery: Delivery[Any] | None,
        call: Callable[[], T],
    ) -> T | Exception:
        """Run ``call`` so that its failure undoes only its own work.

        Returns the call's value, or the (non-transient) exception it raised. In rerun
        mode a failure aborts the whole transaction to be rerun without ``delivery``.
        """
        savepoint = session.begin_nested() if savepoints else None
        try:
            value = call()
            session.flush()
        except Exception as raised:
            error = raised
            if is_transient(error):
                if not self._waits_for_own_lock(session, error):
                    raise
                error = _self_deadlock(error)
            if savepoint is None:
                raise _RerunWithoutError(delivery, error) from error
            savepoint.rollback()
            self._log_failure(delivery, error)
            return error
        if savepoint is not None:
            savepoint.commit()
        return value

    def _call_handler(self, session: Session, delivery: Delivery[Any]) -> Any:
        if not self.consumer.has_single_handler:
            return self._call_batch_handler(session, [delivery]).get(str(delivery.message.id))
        context = Context(session, self.consumer, delivery.message)
        started = time.monotonic()
        with tracing.consume_span(self.name, delivery.message):
            result = self.consumer.handle(delivery.message, context)
        self.metrics.histograms.observe("handler_seconds", time.monotonic() - started)
        _ensure_json(result)
        return result

    def _call_batch_handler(self, session: Session, new: list[Delivery[Any]]) -> dict[str, Any]:
        messages = [d.message for d in new]
        started = time.monotonic()
        with tracing.batch_span(self.name, messages):
            results = self.consumer.handle_batch(
                messages, BatchContext(session, self.consumer, messages)
            )
        self.metrics.histograms.observe("handler_seconds", time.monotonic() - started)
        if not results:
            return {}
        # Only results of this batch's messages: another key would overwrite the stored
        # result of an earlier message (or reach the database as an invalid id).
        ids = {d.message.id for d in new}
        clean = {key: value for key, value in results.items() if value is not None and key in ids}
        for value in clean.values():
            _ensure_json(value)
        return clean

    def _waits_for_own_lock(self, session: Session, error: Exception) -> bool:
        """True when a handler's SQLite "database is locked" is our own transaction's lock.

        The processor's transaction on SQLite holds the file's write lock from its claim
        on (the only writer SQLite allows): a lock wait seen inside a handler then comes
        from the handler's own connection to that file and can never end in success.
        """
        return (
            is_sqlite_lock_error(error)
            and session.in_transaction()
            and session.get_bind().dialect.name == "sqlite"
        )

    def _committed(self, outcome: _Pass, report: BatchReport) -> None:
        """After a commit: the after-commit hook, duplicate callbacks, bookkeeping."""
        report.processed.extend(outcome.processed)
        report.duplicates.extend(outcome.duplicates)
        report.results.update(outcome.stored_results)
        report.results.update(outcome.results)
        self.metrics.processed += len(outcome.processed)
        self.metrics.duplicates += len(outcome.duplicates)
        if outcome.processed:
            self.consumer.after_commit([d.message for d in outcome.processed])
        if self.consumer.wants_duplicate_results:
            for delivery in outcome.duplicates:
                self.consumer.on_duplicate(
                    delivery.message, outcome.stored_results.get(str(delivery.message.id))
                )

    def _retry(self, delivery: Delivery[Any], error: Exception, report: BatchReport) -> None:
        """Rerun one failed message in its own transactions until done or out of attempts."""
        attempts = 1
        while True:
            if isinstance(error, MessageError):
                report.dead_lettered.append((delivery, self._dead_letter_record(error, attempts)))
                return
            attempts = self._with_database_retry(
                functools.partial(self._record_failure, delivery, error)
            )
            self.metrics.failures += 1
            if attempts >= self.policy.max_attempts:
                report.dead_lettered.append((delivery, self._dead_letter_record(error, attempts)))
                return
            if not self._pause(self.policy.backoff(attempts)):
                report.unsettled.append(delivery)  # stopping: leave it to the next owner
                return
            self.metrics.retries += 1
            rerun = self._own_transaction if self.per_message else self._run_one
            outcome = self._with_database_retry(functools.partial(rerun, delivery))
            if not outcome.failures:
                self._committed(outcome, report)
                return
            error = outcome.failures[0][1]

    # -- careful mode: deliveries that came back -------------------------------------------

    def _run_carefully(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> list[Delivery[Any]]:
        """Process the redelivered deliveries one at a time; return the others.

        A redelivered message may be the one whose handler killed the previous worker
        (``os._exit``, OOM, a segfault): nothing could record that attempt. So each
        redelivered message that is not a duplicate gets its attempt counted and
        committed *before* its handler runs, then runs alone in its own transaction. A
        process-killer thus reaches ``max_attempts`` and is dead-lettered without
        running again, and its batch-mates are processed around it. Committed
        duplicates (the common redelivery, after a crash between commit and settle) are
        found with one read for the whole batch and cost nothing more.
        """
        careful = [d for d in deliveries if d.message.redelivered]
        others = [d for d in deliveries if not d.message.redelivered]
        fresh = self._skip_processed(careful, report)
        lease = _SessionLease(self.sessions)
        try:
            for index, delivery in enumerate(fresh):
                if self.stop.requested:
                    report.unsettled.extend(fresh[index:])
                    report.unsettled.extend(others)
                    return []
                self._careful_one(delivery, lease, report)
        finally:
            lease.close()
        return others

    def _skip_processed(
        self, deliveries: list[Delivery[Any]], report: BatchReport
    ) -> list[Delivery[Any]]:
        """Settle the deliveries whose claims are committed; return the rest (one read)."""
        if not self.consumer.deduplicate or not deliveries:
            return deliveries
        ids = [str(d.message.id) for d in deliveries]
        done = self._with_database_retry(functools.partial(self._read_processed, ids))
        if not done:
            return deliveries
        duplicates = [d for d in deliveries if d.message.id in done]
        stored = {key: value for key, value in done.items() if value is not None}
        self._committed(_Pass(duplicates=duplicates, stored_results=stored), report)
        return [d for d in deliveries if d.message.id not in done]

    def _read_processed(self, ids: list[str]) -> dict[str, Any]:
        with self.sessions() as session, session.begin():
            return self.store.processed(session, self.name, ids)

    def _careful_one(
        self, delivery: Delivery[Any], lease: _SessionLease, report: BatchReport
    ) -> None:
        """Count the attempt first, then run the message alone; retry up to the policy."""
        message_id = str(delivery.message.id)
        while True:
            attempts, last_error, started = self._with_database_retry(
                functools.partial(self._start_attempt, message_id, lease)
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
            outcome = self._with_database_retry(
                functools.partial(self._own_transaction, delivery, lease)
            )
            self._committed(outcome, report)
            if outcome.duplicates:  # claimed meanwhile by another worker: nothing ran
                self._with_database_retry(
                    functools.partial(self._in_transaction, self.store.undo_attempt, message_id)
                )
            if not outcome.failures:
                return
            error = outcome.failures[0][1]
            self._with_database_retry(
                functools.partial(
                    self._in_transaction,
                    self.store.finish_attempt,
                    message_id,
                    clean_text(f"{type(error).__name__}: {error}"),  # no NUL / surrogates
                )
            )
            self.metrics.failures += 1
            if isinstance(error, MessageError) or attempts >= self.policy.max_attempts:
                report.dead_lettered.append((delivery, self._dead_letter_record(error, attempts)))
                return
            if not self._pause(self.policy.backoff(attempts)):
                report.unsettled.append(delivery)  # stopping: leave it to the next owner
                return
            self.metrics.retries += 1

    def _start_attempt(self, message_id: str, lease: _SessionLease) -> tuple[int, str | None, bool]:
        session = lease.session()
        try:
            with session.begin():
                return self.store.start_attempt(
                    session, self.name, message_id, WORKER_DIED, self.policy.max_attempts
                )
        except BaseException:
            lease.close()
            raise

    def _in_transaction(self, write: Callable[..., None], *args: str) -> None:
        with self.sessions() as session, session.begin():
            write(session, self.name, *args)

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

    def _run_one(self, delivery: Delivery[Any]) -> _Pass:
        return self._run_pass([delivery])

    def _record_failure(self, delivery: Delivery[Any], error: Exception) -> int:
        with self.sessions() as session, session.begin():
            # The error text may carry NUL or a lone surrogate, which PostgreSQL refuses.
            text = clean_text(f"{type(error).__name__}: {error}")
            return self.store.record_failure(session, self.name, str(delivery.message.id), text)

    def _resolve_repeats(
        self, repeats: list[tuple[Delivery[Any], str]], report: BatchReport
    ) -> None:
        """A repeat inside the batch shares the fate of its first copy."""
        if not repeats:
            return
        fate: dict[str, Any] = {}
        for delivery in report.processed + report.duplicates:
            fate[str(delivery.message.id)] = "done"
        for delivery, record in report.dead_lettered:
            if delivery.message.id is not None:
                fate[delivery.message.id] = record
        for delivery, message_id in repeats:
            outcome = fate.get(message_id)
            repeat = Delivery(delivery.message.with_id(message_id), delivery.token)
            if outcome == "done":
                report.duplicates.append(repeat)
                self.metrics.duplicates += 1
                if self.consumer.wants_duplicate_results:
                    self.consumer.on_duplicate(repeat.message, report.results.get(message_id))
            elif isinstance(outcome, DeadLetter):
                report.dead_lettered.append((repeat, outcome))
            else:
                report.unsettled.append(repeat)

    def _settle_committed(self, report: BatchReport) -> None:
        """Abandoning a batch: still settle what has committed (fewer redeliveries)."""
        committed = report.processed + report.duplicates
        if committed:
            self.transport.settle(committed)

    def _dead_letter(self, report: BatchReport) -> None:
        """Store dead letters durably; one that cannot be stored stays unsettled.

        A dead letter the broker refuses for good (:class:`DeadLetterRefusedError`) is
        kept in the database's dead-letter table instead, then settled like the others:
        one record the broker will never take must not hold up what comes after it.
        """
        kept: list[tuple[Delivery[Any], DeadLetter]] = []
        for delivery, record in report.dead_lettered:
            extra = {
                "consumer": self.name,
                "message_id": delivery.message.id,
                "coordinates": delivery.message.coordinates,
            }
            try:
                self.transport.dead_letter(delivery, record)
            except DeadLetterRefusedError as refusal:
                self.metrics.dead_letter_failures += 1
                if not self._park(delivery, record, refusal):
                    report.unsettled.append(delivery)
                    continue
                self.metrics.dead_letters_parked += 1
                log.error(
                    "the broker refused the dead letter; kept in the dead-letter table",
                    extra={**extra, "reason": record.reason, "refusal": str(refusal)},
                )
            except Exception:
                self.metrics.dead_letter_failures += 1
                log.exception("dead-letter failed; the message stays unsettled", extra=extra)
                report.unsettled.append(delivery)
                continue
            else:
                log.warning(
                    "dead-lettered",
                    extra={**extra, "reason": record.reason, "attempts": record.attempts},
                )
            kept.append((delivery, record))
        report.dead_lettered = kept

    def _park(self, delivery: Delivery[Any], record: DeadLetter, refusal: Exception) -> bool:
        """Keep a refused dead letter in the database; False if that failed too."""
        cause = DeadLetterCause(
            reason=record.reason,
            attempts=record.attempts,
            refusal=str(refusal),
            error_class=record.error_class,
            error_message=record.error_message,
        )

        def park() -> None:
            with self.sessions() as session, session.begin():
                self.dead_letters.park(session, self.name, delivery.message, cause)

        try:
            self._with_database_retry(park)
        except BatchAbandonedError:
            return False  # stopping while the database is down: the broker keeps it
        except Exception:
            log.exception(
                "could not keep the refused dead letter in the database either; the "
                "message stays unsettled",
                extra={"consumer": self.name, "coordinates": delivery.message.coordinates},
            )
            return False
        return True

    # -- infrastructure retry ------------------------------------------------------------

    def _with_database_retry(self, work: Callable[[], T]) -> T:
        """Run ``work``; on a transient database error wait with backoff and run it again.

        The first attempt runs directly (building the retry machinery costs ~30 µs, a
        tenth of a one-message transaction). After a transient failure the next attempt
        follows at once: a connection found dead in the pool (the database restarted)
        invalidates the pool, so it usually succeeds on a fresh connection; further
        attempts back off.
        """
        try:
            return work()
        except Exception as error:
            if not is_transient(error):
                raise
            self.metrics.database_retries += 1
            self._log_database_error(1, error)
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            wait=wait_random_exponential(
                multiplier=0.1, max=self.policy.infrastructure_backoff_max
            ),
            stop=stop_never,
            sleep=self._infrastructure_sleep,
            before_sleep=self._log_database_retry,
            reraise=True,
        )
        return retrying(work)

    def _infrastructure_sleep(self, seconds: float) -> None:
        if not self._pause(seconds):
            raise BatchAbandonedError("stop requested while the database was unavailable")

    def _log_database_retry(self, state: Any) -> None:
        self.metrics.database_retries += 1
        error = state.outcome.exception() if state.outcome else None
        self._log_database_error(state.attempt_number + 1, error)

    def _log_database_error(self, attempt: int, error: BaseException | None) -> None:
        log.warning(
            "database unavailable; retrying",
            extra={
                "consumer": self.name,
                "attempt": attempt,
                "error": type(error).__name__ if error else None,
            },
        )

    def _pause(self, seconds: float) -> bool:
        """Wait, keeping the broker connection alive; False if a stop was requested."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if self.stop.requested:
                return False
            self.transport.keepalive()
            self.stop.wait(min(remaining, 0.2))
        return not self.stop.requested

    # -- reporting -----------------------------------------------------------------------

    def _dead_letter_record(self, error: Exception, attempts: int) -> DeadLetter:
        if isinstance(error, MessageError):
            reason = error.reason
        else:
            reason = f"handler failed after {attempts} attempts: {type(error).__name__}: {error}"
        # Header-safe and storable: an error text may carry NUL or a lone surrogate.
        return DeadLetter(
            reason=clean_text(reason),
            consumer=self.name,
            attempts=attempts,
            error_class=f"{type(error).__module__}.{type(error).__qualname__}",
            error_message=clean_text(str(error)),
        )

    def _log_failure(self, delivery: Delivery[Any] | None, error: Exception) -> None:
        log.info(
            "handler failed",
            extra={
                "consumer": self.name,
                "message_id": delivery.message.id if delivery else None,
                "error": f"{type(error).__name__}: {error}",
            },
        )

    def _count(self, report: BatchReport, started: float) -> None:
        self.metrics.batches += 1
        self.metrics.dead_lettered += len(report.dead_lettered)
        self.metrics.batch_seconds += time.monotonic() - started


#: Built once: ``json.dumps(..., allow_nan=False)`` would build an encoder per call.
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


def _ensure_json(result: Any) -> None:
    """A handler's result must be strict JSON every database stores the same way.

    Refused, as :class:`InvalidResultError` (the message is dead-lettered at once):
    types JSON does not have, NaN and infinities (PostgreSQL's JSONB rejects them),
    strings with a NUL character or a lone surrogate (JSONB and UTF-8 reject them),
    nesting too deep to serialise.
    """
    if result is None:
        return
    try:
        # ASCII output (the C encoder's fastest path): NUL shows as \u0000 and a
        # surrogate as \udXXX, so two substring searches clear the common result.
        text = _STRICT_JSON.encode(result)
    except TypeError as error:
        raise InvalidResultError(f"handler result is not JSON-serialisable: {error}") from None
    except ValueError as error:  # NaN, Infinity, a circular reference
        raise InvalidResultError(f"handler result is not strict JSON: {error}") from None
    except RecursionError:
        raise InvalidResultError("handler result is nested too deeply to store") from None
    if "\\u0000" in text:
        try:
            has_nul = _has_nul(result)
        except RecursionError:
            has_nul = True  # too deep to look through: refuse rather than guess
        if has_nul:
            raise InvalidResultError("handler result contains a NUL character (\\u0000)")
    if "\\ud" in text or "\\uD" in text:  # surrogates: a valid pair or a lone one
        try:
            json.dumps(result, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidResultError(
                "handler result is not valid Unicode: a string with a lone surrogate"
            ) from None


def _has_nul(value: Any) -> bool:
    """True when a string anywhere in ``value`` (keys included) contains a NUL character."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(key) or _has_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(item) for item in value)
    return False


def _self_deadlock(error: Exception) -> SQLiteSelfDeadlockError:
    deadlock = SQLiteSelfDeadlockError(
        "the handler waited for the SQLite write lock that its own consumer transaction "
        "holds (SQLite allows one writer per file): write through ctx.session, not "
        "through another connection or engine to the same database file"
    )
    deadlock.__cause__ = error
    return deadlock
