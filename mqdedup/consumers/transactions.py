"""The unit of work of SQL claim stores: claim, handlers and results in one transaction.

Each transaction claims the ids (the first statement), runs the handlers of the new
messages with ``ctx.session`` and ``ctx.outbox``, writes the staged rows, stores the
results and commits. Every statement a handler runs executes when it is called, through
an ordinary SQLAlchemy ``Session``; nothing is deferred, reordered or intercepted.

A failing handler's writes and claim are undone and its batch-mates still commit
(``failure_isolation``):

* ``savepoint``: every handler in a savepoint of its own, rolled back when it fails;
* ``rerun``: no savepoints; a failure rolls the transaction back and the batch runs
  again without the failing message;
* ``auto``: like ``rerun`` until the first failure, then with savepoints;
* ``transaction``: one transaction per message (:meth:`TransactionalRuns.one`, driven
  message by message by the Processor).

Staged rows (``ctx.stage``) are written after the last handler, in a savepoint. When they
fail, each message's rows are written again alone, in staging order, so the failure is
traced to its messages; the transaction rolls back and the batch runs once more without
them. A data error no single message's rows reproduce (a deferred constraint at commit,
say) makes each message run in a transaction of its own.

The transaction is checked after every handler and before the commit
(:class:`~mqdedup.db.transaction_state.TransactionWatch`): a handler that left it aborted
(a database error caught without a savepoint) fails like a raising one; one that ended
it (a commit or rollback by a route the guard cannot refuse, an implicit commit) fails
too, what is still open is rolled back, and the claims it committed without their
writes are forgotten so that its batch-mates run again (:meth:`_after_ended`).

The unit of work returns an :class:`~mqdedup.consumers.report.WorkOutcome`; it never calls
back into the Processor. Transient errors (a lost connection, a deadlock) are raised for
the Processor to wait out and retry.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SAWarning
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.bodies import InvalidBodiesError
from mqdedup.consumers.context import (
    HandlerChangedConnectionError,
    guard_session,
    unguard_session,
)
from mqdedup.consumers.handling import Handlers
from mqdedup.consumers.report import WorkOutcome, log_failure
from mqdedup.consumers.staging import StagedWrites, close_stage, open_stage
from mqdedup.db import sqlite_lock
from mqdedup.db.dialects import (
    client_encoding,
    is_data_error,
    is_sqlite_lock_error,
    is_transient,
)
from mqdedup.db.transaction_state import (
    Breakage,
    Broken,
    HandlerBrokeTransactionError,
    TransactionWatch,
    watch_engine,
)

if TYPE_CHECKING:
    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.positions import Positions
    from mqdedup.consumers.spec import ConsumerSpec
    from mqdedup.consumers.transport import Delivery
    from mqdedup.dedup.claims import ClaimStore

T = TypeVar("T")

log = logging.getLogger("mqdedup.consumers.processor")


class SQLiteSelfDeadlockError(RuntimeError):
    """A handler waited for the SQLite write lock its own consumer transaction holds.

    SQLite allows one writer per database file. The processor's transaction takes the
    lock with the claim (mqdedup's engines with ``BEGIN IMMEDIATE``), so a handler that
    writes to the same file through another connection waits until its busy timeout and
    could never succeed. It fails that message instead of retrying the batch forever.
    """


class SessionLease:
    """One connection and one session for a run of one-message transactions.

    Checking a connection out of the pool and building a session for every message
    costs ~100 µs of CPU, a sizeable part of a one-message transaction. The session is
    bound to a connection held for the run; each message still begins and commits its
    own transaction on it. Any error closes both (the next use starts afresh).
    """

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self._session: Session | None = None
        self._connection: Connection | None = None

    def unit(self) -> Session:
        """The leased session (opened on first use)."""
        if self._session is None:
            bind = self._sessions.kw.get("bind")
            if isinstance(bind, Engine):
                self._connection = bind.connect()
                self._session = self._sessions(bind=self._connection)
            else:  # bound elsewhere (several engines, a connection): plain sessions
                self._session = self._sessions()
        return self._session

    def close(self) -> None:
        """Close the session and give the connection back."""
        session, self._session = self._session, None
        connection, self._connection = self._connection, None
        try:
            if session is not None:
                session.close()
        finally:
            if connection is not None:
                connection.close()


@dataclass(frozen=True)
class _Mode:
    """How one transaction over a batch runs its handlers."""

    batch_handler: bool  # handle_batch (else handle per message)
    savepoints: bool  # each handler in a savepoint of its own


@dataclass
class _RolledBack:
    """A transaction that was rolled back, and why (what the next one does differently)."""

    #: Messages whose own failure it was: the next transaction runs without them.
    failed: list[tuple[Delivery[Any], Exception]] = field(default_factory=list)
    #: The batch handler failed (with this error): the next transaction calls ``handle``
    #: per message.
    batch_handler: Exception | None = None
    #: A data error no single message's writes reproduce: run each message alone.
    unattributed: Exception | None = None
    #: A handler ended the transaction (committed, rolled back or replaced it): nothing
    #: was rolled back to; the claims it committed are sorted out before the next one.
    ended: bool = False
    #: Batch-mates that ran before it, committed with their writes by its commit:
    #: processed (their staged rows and results were written after).
    processed: list[Delivery[Any]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)


class TransactionalRuns:
    """Runs deliveries in database transactions: one per batch, or one per message."""

    def __init__(
        self,
        consumer: ConsumerSpec,
        sessions: sessionmaker[Session],
        store: ClaimStore,
        handlers: Handlers,
        metrics: Metrics,
        positions: Positions | None = None,
    ) -> None:
        self.consumer = consumer
        #: Broker positions written in each transaction (Kafka's offsets_in_database).
        self.positions = positions
        #: Whether message ids are claimed (not with positions that make claims needless).
        self.claims = consumer.deduplicate and (positions is None or positions.claims)
        self.sessions = sessions
        self.store = store
        self.handlers = handlers
        self.metrics = metrics
        self.name = consumer.consumer_name
        bind = sessions.kw.get("bind")
        self._sqlite = isinstance(bind, Engine) and bind.dialect.name == "sqlite"
        if self._sqlite:
            sqlite_lock.install()  # a handler's own connection to the file fails fast
        if isinstance(bind, Engine | Connection):
            watch_engine(bind.engine)  # sees a COMMIT statement or an implicit commit

    def lease(self) -> SessionLease:
        """A session for a run of one-message transactions (transaction mode, careful
        mode)."""
        return SessionLease(self.sessions)

    def batch(self, deliveries: Sequence[Delivery[Any]]) -> WorkOutcome:
        """One transaction over ``deliveries`` (run again without the failing messages
        until it commits); the outcome includes the failures."""
        isolation = self.consumer.failure_isolation
        mode = _Mode(
            batch_handler=self.consumer.has_batch_handler,
            savepoints=isolation == "savepoint",
        )
        pending = list(deliveries)
        failed: list[tuple[Delivery[Any], Exception]] = []
        done = WorkOutcome()  # committed by a handler that ended its transaction
        while pending:
            try:
                with self.sessions() as session:
                    result = self._transaction(session, pending, mode)
            except Exception as commit_error:
                if is_transient(commit_error) or not is_data_error(commit_error):
                    raise
                result = _RolledBack(unattributed=commit_error)  # at commit, say
            if isinstance(result, WorkOutcome):
                for delivery, error in result.failures:  # failed in their savepoints
                    log_failure(self.name, delivery, error)
                result.failures[:0] = failed
                result.processed[:0] = done.processed
                result.results.update(done.results)
                return result
            if not (result.failed or result.unattributed or mode.batch_handler):
                raise AssertionError("a transaction rolled back with nothing to change")
            for delivery, error in result.failed:
                log_failure(self.name, delivery, error)
            finished = {id(delivery) for delivery, _error in result.failed}
            finished.update(id(delivery) for delivery in result.processed)
            pending = [delivery for delivery in pending if id(delivery) not in finished]
            failed.extend(result.failed)
            done.processed.extend(result.processed)
            done.results.update(result.results)
            if result.ended:
                done.durable_at = time.monotonic()
            if result.unattributed is not None:
                outcome = self._each_alone(pending, failed, result.unattributed)
                outcome.processed[:0] = done.processed
                outcome.results.update(done.results)
                return outcome
            mode = _Mode(
                batch_handler=mode.batch_handler and result.batch_handler is None,
                savepoints=mode.savepoints or isolation == "auto",
            )
        done.failures = failed
        return done

    def one(self, delivery: Delivery[Any], lease: SessionLease | None = None) -> WorkOutcome:
        """One message in a transaction of its own (on ``lease``'s session if given)."""
        if lease is None:
            with self.sessions() as session:
                return self._alone(session, delivery)
        try:
            return self._alone(lease.unit(), delivery)
        except BaseException:
            lease.close()  # e.g. a dead connection: the retry starts on a fresh one
            raise

    # -- transactions ----------------------------------------------------------------------

    def _alone(self, session: Session, delivery: Delivery[Any]) -> WorkOutcome:
        # ``handle`` when implemented (handle_batch with this one message otherwise)
        mode = _Mode(batch_handler=False, savepoints=False)
        try:
            result = self._transaction(session, [delivery], mode)
        except Exception as commit_error:
            if is_transient(commit_error) or not is_data_error(commit_error):
                raise
            result = _RolledBack(unattributed=commit_error)  # a deferred constraint, say
        finally:
            session.expunge_all()  # the next message starts with an empty session
        if isinstance(result, WorkOutcome):
            return result
        # its handler's, its staged rows', its batch handler's or its commit's error
        own = result.failed[0][1] if result.failed else result.batch_handler
        own = own or result.unattributed
        if own is None:
            raise AssertionError("a one-message transaction rolled back without an error")
        log_failure(self.name, delivery, own)
        return WorkOutcome(failures=[(delivery, own)])

    def _each_alone(
        self,
        pending: list[Delivery[Any]],
        failed: list[tuple[Delivery[Any], Exception]],
        error: Exception,
    ) -> WorkOutcome:
        """A data error no message's writes reproduce alone: each message on its own."""
        outcome = WorkOutcome(failures=list(failed))
        if not pending:
            return outcome
        if len(pending) == 1:
            log_failure(self.name, pending[0], error)
            outcome.failures.append((pending[0], error))
            return outcome
        for delivery in pending:
            outcome.add(self.one(delivery))
        return outcome

    def _transaction(
        self, session: Session, deliveries: Sequence[Delivery[Any]], mode: _Mode
    ) -> WorkOutcome | _RolledBack:
        """Claim, handle, write the staged rows and store results in one transaction of
        ``session``; commit, or roll back and say why."""
        outcome = WorkOutcome()
        store = self.store
        started = time.monotonic()
        transaction = session.begin()
        try:
            new = self._claim(session, deliveries, outcome)
            connection = session.connection()
            encoding = client_encoding(connection)
            staged = open_stage(session)
            claimed = self.claims and bool(deliveries)
            watch = TransactionWatch(session, connection, begun=claimed)
            try:
                rolled_back = self._handle(session, new, outcome, mode, staged, encoding, watch)
                if rolled_back is not None and rolled_back.ended:
                    return self._after_ended(session, watch, new, outcome, staged, rolled_back)
                if rolled_back is None and staged:
                    rolled_back = self._write_staged(session, staged)
                    if rolled_back is not None and outcome.failures:
                        # handlers that failed in their savepoints failed all the same
                        rolled_back.failed = _in_order(
                            deliveries, [*outcome.failures, *rolled_back.failed]
                        )
            finally:
                close_stage(session)
            if rolled_back is not None:
                transaction.rollback()
                return rolled_back
            if outcome.failures and self.claims:
                store.forget(session, self.name, [str(d.message.id) for d, _ in outcome.failures])
            if self.claims and outcome.results:
                store.save_results(session, self.name, outcome.results)
            done = [*outcome.processed, *outcome.duplicates]
            # The positions last: a fenced write (PositionFencedError) rolls back all.
            positioned = self.positions.write(session, done) if self.positions and done else None
            broken = watch.check()  # before every commit: is it still our transaction?
            if broken is not None:
                return self._broken_at_commit(session, watch, new, broken)
            transaction.commit()
        except BaseException:
            session.rollback()  # also after a failed commit: the session is clean again
            raise
        if positioned is not None:
            positioned()
        outcome.durable_at = time.monotonic()
        self.metrics.histograms.observe("transaction_seconds", outcome.durable_at - started)
        return outcome

    def _claim(
        self, session: Session, deliveries: Sequence[Delivery[Any]], outcome: WorkOutcome
    ) -> list[Delivery[Any]]:
        """Claim the ids (the transaction's first statement); return the new deliveries."""
        ids = [d.message.id for d in deliveries if d.message.id is not None]
        if not self.claims:
            return list(deliveries)
        started = time.monotonic()
        new_ids = self.store.claim(session, self.name, ids).new
        self.metrics.histograms.observe("claim_seconds", time.monotonic() - started)
        outcome.duplicates = [d for d in deliveries if d.message.id not in new_ids]
        if outcome.duplicates and self.consumer.wants_duplicate_results:
            outcome.stored_results = self.store.results(
                session, self.name, [str(d.message.id) for d in outcome.duplicates]
            )
        return [d for d in deliveries if d.message.id in new_ids]

    def _handle(
        self,
        session: Session,
        new: list[Delivery[Any]],
        outcome: WorkOutcome,
        mode: _Mode,
        staged: StagedWrites,
        encoding: str | None,
        watch: TransactionWatch,
    ) -> _RolledBack | None:
        """Run the handlers (the session guarded, the transaction checked after each);
        fill ``outcome``. ``encoding``: the connection's client encoding before them
        (None: the driver does not say)."""
        handlers = self.handlers
        guard_session(session, watch.connection)  # the handlers must not end it
        if self._sqlite:
            sqlite_lock.enter(session)
        try:
            if mode.batch_handler and new:
                staged.owner = None
                value = self._isolated(
                    session,
                    mode.savepoints,
                    staged,
                    None,
                    functools.partial(handlers.call_batch, session, new),
                    encoding,
                    watch,
                )
                if isinstance(value, _RolledBack):
                    return value
                if not isinstance(value, Exception):
                    outcome.processed.extend(new)
                    outcome.results.update(value)
                    return None
            for delivery in new:
                staged.owner = delivery
                result = self._isolated(
                    session,
                    mode.savepoints,
                    staged,
                    delivery,
                    functools.partial(handlers.call, session, delivery),
                    encoding,
                    watch,
                )
                if isinstance(result, _RolledBack):
                    return result
                if isinstance(result, Exception):
                    outcome.failures.append((delivery, result))
                    continue
                outcome.processed.append(delivery)
                if result is not None:
                    outcome.results[str(delivery.message.id)] = result
            return None
        finally:
            unguard_session(session)
            watch.close()
            if self._sqlite:
                sqlite_lock.leave()

    def _isolated(
        self,
        session: Session,
        savepoints: bool,
        staged: StagedWrites,
        delivery: Delivery[Any] | None,
        call: Callable[[], T],
        encoding: str | None,
        watch: TransactionWatch,
    ) -> T | Exception | _RolledBack:
        """Run ``call`` so that its failure undoes only its own work.

        Returns the call's value; with savepoints the (non-transient) exception it raised,
        its savepoint rolled back; without, the reason to roll the transaction back.
        Transient errors propagate. A call that left the transaction aborted or ended
        (:class:`TransactionWatch`) failed, with HandlerBrokeTransactionError.
        """
        savepoint = session.begin_nested() if savepoints else None
        mark = staged.mark()
        try:
            value = call()
            broken = watch.check()  # never trust the handler to leave it intact
            if broken is not None:
                return self._broken(broken, None, delivery, savepoint, staged, mark)
            session.flush()  # the ORM's pending writes are the handler's too
            if encoding is not None and client_encoding(session.connection()) != encoding:
                raise HandlerChangedConnectionError(
                    "the handler changed the connection's client_encoding (SET "
                    "client_encoding): claims, results and the next messages share this "
                    "connection; encode or decode in the handler instead"
                )
        except Exception as raised:
            error = raised
            transient = is_transient(error)  # an outage first: never the message's fault
            broken = None if transient else watch.check()
            if broken is not None and (broken.kind is Breakage.ENDED or watch.caught(error)):
                return self._broken(broken, error, delivery, savepoint, staged, mark)
            if transient:
                if not _waits_for_own_lock(session, error):
                    raise
                error = _self_deadlock(error)
            if savepoint is None:
                return _blamed(delivery, error)
            savepoint.rollback()
            staged.undo(mark)
            return error
        if savepoint is not None:
            savepoint.commit()
        return value

    def _broken(
        self,
        broken: Broken,
        raised: Exception | None,
        delivery: Delivery[Any] | None,
        savepoint: Any,
        staged: StagedWrites,
        mark: int,
    ) -> Exception | _RolledBack:
        """The failure of a call that left the transaction aborted or ended."""
        error = HandlerBrokeTransactionError(broken.reason)
        error.__cause__ = raised
        if broken.kind is Breakage.ENDED:  # no savepoint left to roll back to
            rolled_back = _blamed(delivery, error)
            rolled_back.ended = True
            return rolled_back
        if savepoint is None:
            return _blamed(delivery, error)
        savepoint.rollback()  # ROLLBACK TO SAVEPOINT also ends PostgreSQL's aborted state
        staged.undo(mark)
        return error

    def _after_ended(
        self,
        session: Session,
        watch: TransactionWatch,
        new: list[Delivery[Any]],
        outcome: WorkOutcome,
        staged: StagedWrites,
        rolled_back: _RolledBack,
    ) -> _RolledBack:
        """A handler ended the transaction: whatever it committed is sorted out.

        Everything still open is rolled back. When the handler committed, the claims of
        the whole batch and the writes of the batch-mates before it are durable: those
        batch-mates are processed (their staged rows and results are written now); the
        claims of the culprit, of the batch-mates that failed before it and of those
        after it are forgotten, so that the culprit is retried and the others run again.
        When it rolled back, nothing is durable and everything runs again.
        """
        discard(session, watch)
        culprit = rolled_back.failed[0][0] if rolled_back.failed else None
        ids = [str(delivery.message.id) for delivery in new]
        if not self.claims or not ids:
            return rolled_back
        with session.begin():
            # Claiming again tells which claims the handler committed (and takes the rest,
            # forgotten again below): one statement, as for any batch.
            fresh = set(self.store.claim(session, self.name, ids).new)
            committed = culprit is None or str(culprit.message.id) not in fresh
            kept = [d for d in outcome.processed if committed and d.message.id not in fresh]
            kept_ids = {id(delivery) for delivery in kept}
            forget = [str(d.message.id) for d in new if id(d) not in kept_ids]
            self.store.forget(session, self.name, forget)
            if kept:
                connection = session.connection()
                for delivery in kept:
                    staged.write_alone(connection, delivery)
                results = {
                    key: value
                    for key, value in outcome.results.items()
                    if key in {str(d.message.id) for d in kept}
                }
                if results:
                    self.store.save_results(session, self.name, results)
                rolled_back.processed = kept
                rolled_back.results = results
        if committed and outcome.failures:  # failed in their savepoints before it
            rolled_back.failed = _in_order(new, [*outcome.failures, *rolled_back.failed])
        log.warning(
            "a handler ended the consumer's transaction; its message failed",
            extra={
                "consumer": self.name,
                "message_id": culprit.message.id if culprit else None,
                "committed": committed,
                "processed_before_it": len(kept),
            },
        )
        return rolled_back

    def _broken_at_commit(
        self, session: Session, watch: TransactionWatch, new: list[Delivery[Any]], broken: Broken
    ) -> _RolledBack:
        """The transaction is no longer ours at commit although every handler left it
        intact (a statement on the raw driver connection, say): nothing of it commits,
        claims it may have committed are forgotten and each message runs alone."""
        discard(session, watch)
        if self.claims and new:
            with session.begin():
                self.store.forget(session, self.name, [str(d.message.id) for d in new])
        return _RolledBack(unattributed=HandlerBrokeTransactionError(broken.reason))

    def _write_staged(self, session: Session, staged: StagedWrites) -> _RolledBack | None:
        """Write the staged rows in a savepoint; when they fail, find whose they are."""
        owners = staged.owners()
        if len(owners) == 1:  # one owner: no savepoint needed to know whose they are
            try:
                staged.flush(session.connection())
            except Exception as error:
                if is_transient(error):
                    raise
                return _blamed(owners[0], error)
            return None
        savepoint = session.begin_nested()
        connection = session.connection()  # this is what emits the SAVEPOINT
        try:
            staged.flush(connection)
        except Exception as error:
            if is_transient(error):
                raise
            savepoint.rollback()
            return self._trace(session, staged, owners, error)
        savepoint.commit()
        return None

    def _trace(
        self, session: Session, staged: StagedWrites, owners: list[Any], error: Exception
    ) -> _RolledBack:
        """Write each owner's staged rows alone (in a savepoint each) to find the failing
        messages; the transaction is rolled back afterwards either way."""
        if any(owner is None for owner in owners):  # the batch handler's rows
            return _blamed(None, error)
        failed: list[tuple[Delivery[Any], Exception]] = []
        for owner in owners:
            savepoint = session.begin_nested()
            connection = session.connection()  # this is what emits the SAVEPOINT
            try:
                staged.write_alone(connection, owner)
            except Exception as own_error:
                if is_transient(own_error):
                    raise
                savepoint.rollback()
                failed.append((owner, own_error))
                continue
            savepoint.commit()
        return _RolledBack(failed=failed) if failed else _RolledBack(unattributed=error)


def discard(session: Session, watch: TransactionWatch) -> None:
    """Roll back what is open after a handler ended the transaction: the Connection's
    transaction (one the handler began after its commit, say), the driver connection's
    (begun by a statement SQLAlchemy did not see) and the session's state (its savepoints
    and transaction objects no longer exist on the server, which SQLAlchemy warns about)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SAWarning)
        for rollback in (watch.connection.rollback, watch.rollback_driver, session.rollback):
            try:
                rollback()
            except Exception as error:  # ROLLBACK TO a savepoint the commit removed, say
                if is_transient(error):
                    raise
                log.debug("rollback after a broken transaction failed", exc_info=True)
        if session.in_transaction():
            session.rollback()
        if session.bind is not watch.connection:
            # The session gives its connection back when its transaction ends; when the
            # handler ended it (the root transaction's commit()), the guard refused that
            # close(), so the connection would stay checked out until garbage collection.
            watch.connection.close()


def _blamed(owner: Delivery[Any] | None, error: Exception) -> _RolledBack:
    """The rollback for ``owner``'s own failure (None: the batch handler's, so the next
    transaction calls ``handle`` per message)."""
    if owner is None:
        if isinstance(error, InvalidBodiesError):  # typed bodies: the batch runs without them
            return _RolledBack(failed=list(error.failed))
        return _RolledBack(batch_handler=error)
    return _RolledBack(failed=[(owner, error)])


def _waits_for_own_lock(session: Session, error: Exception) -> bool:
    """True when a handler's SQLite "database is locked" is our own transaction's lock.

    The processor's transaction on SQLite holds the file's write lock from its claim on
    (the only writer SQLite allows): a lock wait seen inside a handler then comes from
    the handler's own connection to that file and can never end in success.
    """
    return (
        is_sqlite_lock_error(error)
        and session.in_transaction()
        and session.get_bind().dialect.name == "sqlite"
    )


def _self_deadlock(error: Exception) -> SQLiteSelfDeadlockError:
    """The error a handler gets instead of waiting for its own transaction's lock."""
    deadlock = SQLiteSelfDeadlockError(
        "the handler waited for the SQLite write lock that its own consumer transaction "
        "holds (SQLite allows one writer per file): write through ctx.session, not "
        "through another connection or engine to the same database file"
    )
    deadlock.__cause__ = error
    return deadlock


def _in_order(
    deliveries: Sequence[Delivery[Any]], failures: list[tuple[Delivery[Any], Exception]]
) -> list[tuple[Delivery[Any], Exception]]:
    """``failures`` in delivery order (their retries run in that order)."""
    position = {id(delivery): index for index, delivery in enumerate(deliveries)}
    return sorted(failures, key=lambda failure: position[id(failure[0])])
