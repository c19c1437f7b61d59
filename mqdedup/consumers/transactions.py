"""SQL claim stores: claim, handlers and results in one database transaction.

The unit of work of a transactional claim store (``SqlDedup``, the default): each
transaction claims the ids, runs the handlers for the new ones with ``ctx.session``
and ``ctx.outbox``, stores their results and commits. A failing handler's writes and
claim are undone (a savepoint, or a rerun of the transaction without it) and its
batch-mates still commit (``failure_isolation``). Transaction mode on PostgreSQL with
psycopg runs its messages through :mod:`~mqdedup.consumers.lean_transactions`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.context import guard_session, unguard_session
from mqdedup.consumers.deferral import (
    DeferredResultUnavailableError,
    close_deferral,
    open_deferral,
)
from mqdedup.consumers.lean_transactions import LeanLease, LeanTransactions
from mqdedup.consumers.report import BatchReport, Outcome
from mqdedup.consumers.sessions import SessionLease, self_deadlock, waits_for_own_lock
from mqdedup.consumers.staging import StagedWrites, close_stage, open_stage, staged_writes
from mqdedup.db import sqlite_lock
from mqdedup.db.dialects import is_data_error, is_transient

if TYPE_CHECKING:
    from mqdedup.consumers.pipeline import Pipeline
    from mqdedup.consumers.transport import Delivery

log = logging.getLogger(__name__)
T = TypeVar("T")


#: A ``sessionmaker`` ``info`` key: True turns deferred writes off for its sessions.
NO_DEFERRED_WRITES = "mqdedup.no_deferred_writes"


class _RerunWithoutError(Exception):
    def __init__(
        self,
        delivery: Delivery[Any] | None,
        error: Exception,
        *,
        staged: bool = False,
    ) -> None:
        super().__init__(str(error))
        # None: the batch handler or the staged / deferred writes failed (no single
        # message to blame): rerun per message
        self.delivery = delivery
        self.error = error
        self.staged = staged  # staged / deferred writes failed: rerun writing at once


@dataclass(frozen=True)
class _Pass:
    """How one transaction over a batch runs its handlers."""

    batch_handler: bool = False  # handle_batch (else handle per message)
    savepoints: bool = False  # each handler in a savepoint of its own
    stage_at_once: bool = False  # ctx.stage writes at once (else at the batch end)
    defer: bool = False  # ctx.session.execute() of plain writes deferred (deferral.py)


class TransactionalRuns:
    """Runs deliveries in database transactions for the Processor."""

    def __init__(self, processor: Pipeline, sessions: sessionmaker[Session]) -> None:
        self.p = processor
        self.sessions = sessions
        self.consumer = processor.consumer
        self.name = processor.name
        self.per_message = self.consumer.failure_isolation == "transaction"
        # Transaction mode holds one message per transaction: nothing to write together.
        # Sessions whose connection is also written outside SQLAlchemy (Django's ORM) opt
        # out: those statements would not write the deferred queue before they run.
        opted_out = (sessions.kw.get("info") or {}).get(NO_DEFERRED_WRITES) is True
        self.defer = self.consumer.defer_writes and not self.per_message and not opted_out
        # Transaction mode on PostgreSQL (psycopg): one query per message.
        self.lean: LeanTransactions | None = None
        bind = sessions.kw.get("bind")
        if isinstance(bind, Engine) and LeanTransactions.applies(processor, sessions, opted_out):
            self.lean = LeanTransactions(processor, bind, sessions, self.own_transaction)
        self._sqlite = isinstance(bind, Engine) and bind.dialect.name == "sqlite"
        if self._sqlite:
            sqlite_lock.install()  # a handler's own connection to the file fails fast

    # -- what the Processor calls --------------------------------------------------------

    def first(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> list[tuple[Delivery[Any], Exception]]:
        """Run a batch once (one transaction, or one per message); return the failures."""
        if self.per_message:
            return self._run_each(deliveries, report)
        outcome = self.p.outages.run(lambda: self._run_pass(deliveries))
        self.p.committed(outcome, report)
        return outcome.failures

    def again(self, delivery: Delivery[Any]) -> Outcome:
        """Run one failed message again in a transaction of its own."""
        rerun = self.own_transaction if self.per_message else self._run_one
        return self.p.outages.run(functools.partial(rerun, delivery))

    def lease(self) -> SessionLease:
        """One session for a run of single-message transactions (careful mode)."""
        return SessionLease(self.sessions)

    def alone(self, delivery: Delivery[Any], lease: SessionLease) -> Outcome:
        """One message in its own transaction on ``lease``'s session."""
        return self.own_transaction(delivery, lease)

    # -- transactions ----------------------------------------------------------------------

    def _run_each(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> list[tuple[Delivery[Any], Exception]]:
        """Transaction mode: one transaction per message, each committed on its own.

        On a stop request the rest of the batch is left unsettled for the next owner.
        """
        failures: list[tuple[Delivery[Any], Exception]] = []
        lease = self.lean.lease() if self.lean is not None else SessionLease(self.sessions)
        try:
            for index, delivery in enumerate(deliveries):
                if self.p.stop.requested:
                    report.unsettled.extend(deliveries[index:])
                    break
                following = deliveries[index + 1] if index + 1 < len(deliveries) else None
                outcome = self.p.outages.run(
                    functools.partial(self._one, delivery, following, lease)
                )
                self.p.committed(outcome, report)
                failures.extend(outcome.failures)
        finally:
            lease.close()
        return failures

    def _one(
        self,
        delivery: Delivery[Any],
        following: Delivery[Any] | None,
        lease: SessionLease | LeanLease,
    ) -> Outcome:
        """Transaction mode's first pass over one message (``following`` is next)."""
        if isinstance(lease, LeanLease):
            assert self.lean is not None
            return self.lean.run(delivery, lease, following)
        return self.own_transaction(delivery, lease)

    def own_transaction(
        self, delivery: Delivery[Any], lease: SessionLease | None = None
    ) -> Outcome:
        """One message in its own transaction; a handler failure rolls back only it."""
        if lease is None:
            with self.sessions() as session:
                return self._own_transaction_in(session, delivery)
        try:
            return self._own_transaction_in(lease.unit(), delivery)
        except BaseException:
            lease.close()  # e.g. a dead connection: the retry starts on a fresh one
            raise

    def _own_transaction_in(self, session: Session, delivery: Delivery[Any]) -> Outcome:
        try:
            return self._transaction_in(session, [delivery], _Pass(defer=self.defer))
        except _RerunWithoutError as failed:  # rolled back: its claim is gone too
            self.p.log_failure(delivery, failed.error)
            return Outcome(failures=[(delivery, failed.error)])
        except Exception as error:
            if is_transient(error) or not is_data_error(error):
                raise
            # Its own data, outside the handler (e.g. a deferred constraint at commit).
            self.p.log_failure(delivery, error)
            return Outcome(failures=[(delivery, error)])
        finally:
            session.expunge_all()  # the next message starts with an empty session

    def _run_one(self, delivery: Delivery[Any]) -> Outcome:
        return self._run_pass([delivery])

    def _run_pass(self, deliveries: Sequence[Delivery[Any]]) -> Outcome:
        """One transaction over ``deliveries``: claim, handle the new ones, commit.

        Without savepoints a handler failure rolls the transaction back; it is then run
        again without the failing message (``auto`` reruns with savepoints, so one more
        failure does not cost another rerun). When the staged writes fail at the end,
        the batch runs again with ``ctx.stage`` writing at once, inside each handler's
        failure boundary, so the failing message is found.
        """
        pending = list(deliveries)
        excluded: list[tuple[Delivery[Any], Exception]] = []
        mode = _Pass(
            batch_handler=self.consumer.has_batch_handler,
            savepoints=self.consumer.failure_isolation == "savepoint",
            defer=self.defer,
        )
        while pending:
            try:
                with self.sessions() as session:
                    outcome = self._transaction_in(session, pending, mode)
            except _RerunWithoutError as rerun:
                mode = self._next_pass(mode, rerun, len(pending))
                if rerun.delivery is not None:
                    pending.remove(rerun.delivery)
                    excluded.append((rerun.delivery, rerun.error))
                    self.p.log_failure(rerun.delivery, rerun.error)
                continue
            except Exception as error:
                if is_transient(error) or not is_data_error(error):
                    raise
                return self._find_data_error(pending, excluded, error)
            outcome.failures.extend(excluded)
            return outcome
        return Outcome(failures=excluded)

    def _next_pass(self, mode: _Pass, rerun: _RerunWithoutError, size: int) -> _Pass:
        """How to run a batch again after ``rerun`` ended its transaction."""
        auto = self.consumer.failure_isolation == "auto"
        mode = dataclasses.replace(mode, savepoints=auto or mode.savepoints)
        if rerun.delivery is not None:
            return mode
        mode = dataclasses.replace(mode, batch_handler=False)
        if isinstance(rerun.error, DeferredResultUnavailableError):
            self.defer = False
            log.info(
                "a handler reads results of writes across handler calls: this "
                "consumer's writes are executed at once from now on",
                extra={"consumer": self.name},
            )
            return dataclasses.replace(mode, defer=False)
        if rerun.staged:
            log.warning(
                "the batch's staged or deferred writes failed; running it again with "
                "each message's writes made at once, to find the failing message",
                extra={
                    "consumer": self.name,
                    "size": size,
                    "error": f"{type(rerun.error).__name__}: {rerun.error}",
                },
            )
            mode = dataclasses.replace(mode, stage_at_once=True, defer=False)
        return mode

    def _find_data_error(
        self,
        pending: list[Delivery[Any]],
        excluded: list[tuple[Delivery[Any], Exception]],
        error: Exception,
    ) -> Outcome:
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
            self.p.log_failure(pending[0], error)
            return Outcome(failures=[*excluded, (pending[0], error)])
        outcome = Outcome(failures=list(excluded))
        for delivery in pending:
            outcome.add(self._run_pass([delivery]))
        return outcome

    def _transaction_in(
        self,
        session: Session,
        deliveries: Sequence[Delivery[Any]],
        mode: _Pass,
    ) -> Outcome:
        """Claim, handle, write the staged rows and store results in one transaction of
        ``session``; commit."""
        try:
            return self._staged_transaction_in(session, deliveries, mode)
        finally:
            staged = staged_writes(session)
            if staged is not None and staged.deferred is not None:
                close_deferral(staged.deferred)
            close_stage(session)

    def _staged_transaction_in(
        self, session: Session, deliveries: Sequence[Delivery[Any]], mode: _Pass
    ) -> Outcome:
        outcome = Outcome()
        store = self.p.store
        metrics = self.p.metrics
        deduplicate = self.consumer.deduplicate
        started = time.monotonic()
        with session.begin():
            ids = [d.message.id for d in deliveries if d.message.id is not None]
            if deduplicate:
                new_ids = store.claim(session, self.name, ids).new
                metrics.histograms.observe("claim_seconds", time.monotonic() - started)
            else:
                new_ids = set(ids)
            new = [d for d in deliveries if d.message.id in new_ids]
            outcome.duplicates = [d for d in deliveries if d.message.id not in new_ids]
            if outcome.duplicates and self.consumer.wants_duplicate_results:
                outcome.stored_results = store.results(
                    session, self.name, [str(d.message.id) for d in outcome.duplicates]
                )
            staged = open_stage(session, immediate=mode.stage_at_once)
            if mode.defer and not mode.savepoints and not mode.stage_at_once and new:
                staged.deferred = open_deferral(session)
            guard_session(session)  # the handlers must not end this transaction
            if staged.deferred is not None:
                session.__dict__["execute"] = staged.deferred.execute
            if self._sqlite:
                sqlite_lock.enter(session)
            try:
                results = self._handle(session, new, outcome, mode, staged)
            finally:
                unguard_session(session)
                session.__dict__.pop("execute", None)
                if self._sqlite:
                    sqlite_lock.leave()
            if staged:
                self._write_staged(staged, new, outcome)
            outcome.results = results
            if outcome.failures and deduplicate:
                store.forget(session, self.name, [str(d.message.id) for d, _ in outcome.failures])
            if deduplicate and results:
                store.save_results(session, self.name, results)
        self.p.last_commit = time.monotonic()
        metrics.histograms.observe("transaction_seconds", self.p.last_commit - started)
        return outcome

    def _write_staged(
        self, staged: StagedWrites, new: list[Delivery[Any]], outcome: Outcome
    ) -> None:
        """Run the staged statements; a failure reruns the batch to find its message."""
        try:
            staged.flush()
        except Exception as error:
            if is_transient(error):
                raise
            # One message in the transaction: the failure is its own.
            alone = outcome.processed[0] if len(outcome.processed) == 1 else None
            raise _RerunWithoutError(alone, error, staged=True) from error

    def _handle(
        self,
        session: Session,
        new: list[Delivery[Any]],
        outcome: Outcome,
        mode: _Pass,
        staged: StagedWrites,
    ) -> dict[str, Any]:
        """Run the handlers; fill ``outcome.processed`` / ``failures``; return results."""
        handlers = self.p.handlers
        savepoints = mode.savepoints
        results: dict[str, Any] = {}
        if mode.batch_handler and new:
            batch_results = self._isolated(
                session, savepoints, staged, None, lambda: handlers.call_batch(session, new)
            )
            if not isinstance(batch_results, Exception):
                outcome.processed.extend(new)
                return batch_results
        for delivery in new:
            result = self._isolated(
                session,
                savepoints,
                staged,
                delivery,
                functools.partial(handlers.call, session, delivery),
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
        staged: StagedWrites,
        delivery: Delivery[Any] | None,
        call: Callable[[], T],
    ) -> T | Exception:
        """Run ``call`` so that its failure undoes only its own work.

        Returns the call's value, or the (non-transient) exception it raised. In rerun
        mode a failure aborts the whole transaction to be rerun without ``delivery``.
        """
        savepoint = session.begin_nested() if savepoints else None
        mark = staged.mark()
        deferred = staged.deferred
        if deferred is not None:
            deferred.enter_handler()
        try:
            value = call()
            session.flush()
            if deferred is not None and deferred.failed is not None:
                raise deferred.failed  # the handler caught it: no way out
        except Exception as raised:
            error = raised
            if deferred is not None and deferred.failed is not None and not is_transient(error):
                # A deferred write failed: maybe another message's; rerun writing at once.
                raise _RerunWithoutError(None, deferred.failed, staged=True) from error
            if is_transient(error):
                if not waits_for_own_lock(session, error):
                    raise
                error = self_deadlock(error)
            if savepoint is None:
                raise _RerunWithoutError(delivery, error) from error
            savepoint.rollback()
            staged.undo(mark)
            self.p.log_failure(delivery, error)
            return error
        finally:
            if deferred is not None:
                deferred.leave_handler()
        if savepoint is not None:
            savepoint.commit()
        return value
