"""Transaction mode on PostgreSQL (psycopg): one query per message.

``failure_isolation = "transaction"`` commits every message on its own. Through the
Session that costs four round trips (BEGIN, claim, the handler's write, COMMIT) and
~380 µs of client Python per message. On PostgreSQL with psycopg this path sends one
query per message once the handler has run:

* the handler's deferred plain ``insert(table)`` rows, the stored result, ``COMMIT``,
  and then ``BEGIN; INSERT <claim of the next message> … RETURNING``: the claim is
  the first statement of the next message's transaction, which is open while the
  next handler runs. A batch's first message (or one after a failure) is claimed
  with a ``BEGIN; INSERT <claim>`` query of its own.

Values are bound on the client (psycopg's quoting, as its ``ClientCursor``) and the
string goes out in one ``PQexec`` (:class:`Wire`). When that query fails, the
message's claim row tells whether its COMMIT had run (the next claim failed) or not
(its writes or commit failed).

The leased connection runs in driver autocommit, so psycopg sends no ``BEGIN`` of its
own; the Session the handler gets is bound to it and its statements run inside the
transaction begun here. SQLAlchemy keeps one standing transaction on the connection,
which the Session joins without ever committing it: SQLAlchemy never sends a COMMIT of
its own, which could end the next message's transaction. Anything else the handler
does (reads, ORM objects, the outbox, savepoints, writes that are not a plain
``insert(table)``) goes through SQLAlchemy as usual, in the same transaction.

A failing deferred write or commit is not traced to a statement: the transaction is
rolled back and the message runs again at once on the Session path, writes executed
inside the handler, so it fails (retries, dead-lettering) or succeeds exactly as
without this path. Sessions that opt out of deferred writes (Django), async consumers,
other claim stores and other databases keep the Session path, and so do engines with
``begin`` / ``commit`` / ``rollback`` listeners (SQLAlchemy's transaction on the leased
connection stands for the whole batch, so they would not fire per message) and session
factories whose Session would commit the connection's transaction itself
(``join_transaction_mode``). Careful mode and retries run on the Session path too.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.context import guard_session, unguard_session
from mqdedup.consumers.deferral import (
    DeferredResultUnavailableError,
    DeferredWrites,
    close_deferral,
    open_deferral,
)
from mqdedup.consumers.report import Outcome
from mqdedup.db.dialects import is_data_error, is_transient
from mqdedup.dedup.sql_claims import SqlClaimStore
from mqdedup.dedup.store import utcnow
from mqdedup.outbox.notify import notify_pending

if TYPE_CHECKING:
    import psycopg
    import psycopg.pq.abc

    from mqdedup.consumers.pipeline import Pipeline
    from mqdedup.consumers.transport import Delivery

log = logging.getLogger(__name__)

#: libpq's PQTRANS_INTRANS: idle in a transaction block (psycopg ``TransactionStatus``).
INTRANS = 2

#: Engine events SQLAlchemy would no longer fire per message on this path.
_ENGINE_TRANSACTION_EVENTS = ("begin", "commit", "rollback")


class LeanLease:
    """One autocommit connection, its :class:`Wire` and a Session bound to it,
    kept for a run of single-message transactions. Any error closes them."""

    def __init__(self, engine: Engine, sessions: sessionmaker[Session]) -> None:
        self._engine = engine
        self._sessions = sessions
        self.session: Session | None = None
        self.connection: Connection | None = None
        self.cursor: Wire | None = None
        #: The message whose transaction is open with its claim made, and whether it
        #: was new (claimed with the previous message's commit).
        self.claimed: tuple[str, bool] | None = None

    def open(self) -> tuple[Session, Connection, Wire]:
        """The lease's session, connection and wire (connected on first use)."""
        if self.session is None or self.connection is None or self.cursor is None:
            connection = self._engine.connect()
            try:
                connection.execution_options(isolation_level="AUTOCOMMIT")
                self.cursor = Wire(_driver(connection))
                _standing(connection)
            except BaseException:
                connection.close()
                raise
            self.connection = connection
            self.session = self._sessions(bind=connection)
        return self.session, self.connection, self.cursor

    def take_claim(self, message_id: str) -> bool | None:
        """Whether ``message_id``, claimed in the open transaction, was new (None: not
        claimed yet; a transaction open for another message is rolled back)."""
        claimed, self.claimed = self.claimed, None
        if claimed is None:
            return None
        if self.connection is None:
            return None
        driver = _driver(self.connection)
        if claimed[0] == message_id and driver.pgconn.transaction_status == INTRANS:
            return claimed[1]
        driver.rollback()
        return None

    def close(self) -> None:
        """Roll back what is open, close the session and give the connection back (the
        pool restores the isolation level)."""
        session, self.session = self.session, None
        connection, self.connection = self.connection, None
        cursor, self.cursor = self.cursor, None
        self.claimed = None
        try:
            if cursor is not None:
                cursor.close()
            if session is not None:
                session.close()
            if connection is not None and not connection.invalidated:
                try:
                    _driver(connection).rollback()  # e.g. a next message's claim
                except Exception:  # a dead connection: not back into the pool
                    connection.invalidate()
        finally:
            if connection is not None:
                connection.close()


class Wire:
    """Sends a query string with its values bound on the client (psycopg's quoting, as
    its ``ClientCursor``) in one libpq ``PQexec``; returns the last statement's result.

    Several statements in one string run in order and stop at the first error. The
    driver's cursor machinery costs ~60 µs of CPU per query, as much as the rest of a
    message's path: this is the lean path's one hot call. libpq waits for the answer
    with the GIL released; a Ctrl-C is handled once it has come (psycopg's own wait
    would cancel the query).
    """

    def __init__(self, driver: psycopg.Connection[Any]) -> None:
        from psycopg import ClientCursor  # the postgresql extra, here for sure
        from psycopg.pq import ConnStatus, ExecStatus

        self.driver = driver
        self._pgconn = driver.pgconn
        self._binder = ClientCursor(driver)
        self._encoding = driver.info.encoding
        self._ok = (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK)
        self._connected = ConnStatus.OK

    def send(self, query: str, params: Sequence[Any] = ()) -> psycopg.pq.abc.PGresult:
        """Run ``query`` (``%s`` placeholders bound to ``params``); psycopg's errors."""
        sql = self._binder.mogrify(query, params) if params else query
        result = self._pgconn.exec_(sql.encode(self._encoding))
        if result.status in self._ok:
            return result
        import psycopg

        if self._pgconn.status != self._connected:
            message = self._pgconn.error_message.decode(self._encoding, "replace").strip()
            raise psycopg.OperationalError(f"the connection was lost: {message}")
        raise psycopg.errors.error_from_result(result, encoding=self._encoding)

    def close(self) -> None:
        self._binder.close()


class _WriteAtOnceError(Exception):
    """The deferred writes or the commit failed: run the message on the Session path."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class LeanTransactions:
    """One message per transaction, one query per message (see the module docstring)."""

    def __init__(
        self,
        processor: Pipeline,
        engine: Engine,
        sessions: sessionmaker[Session],
        fallback: Callable[[Delivery[Any]], Outcome],
    ) -> None:
        self.p = processor
        self.engine = engine
        self.sessions = sessions
        self.consumer = processor.consumer
        self.name = processor.name
        #: One message on the Session path (its own transaction, writes at once).
        self.fallback = fallback
        self.defer = self.consumer.defer_writes
        store = processor.store
        assert isinstance(store, SqlClaimStore)
        table = store.table.schema.processed
        preparer = engine.dialect.identifier_preparer
        name = preparer.format_table(table)
        self._begin_sql = (
            f"BEGIN; INSERT INTO {name} (consumer_name, message_id, processed_at) "
            "VALUES (%s, %s, %s) "
            "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
        )
        self._result_sql = (
            f"UPDATE {name} SET result = %s WHERE consumer_name = %s AND message_id = %s"
        )
        self._committed_sql = f"SELECT 1 FROM {name} WHERE consumer_name = %s AND message_id = %s"
        result_type = table.c.result.type.dialect_impl(engine.dialect)
        dump = result_type._cached_bind_processor(engine.dialect)
        self._dump_result: Callable[[Any], Any] = dump if dump is not None else _same

    @staticmethod
    def applies(processor: Pipeline, sessions: sessionmaker[Session], opted_out: bool) -> bool:
        """True when ``processor``'s transaction mode can take this path."""
        bind = sessions.kw.get("bind")
        joins = sessions.kw.get("join_transaction_mode", "conservative_savepoint")
        return (
            processor.consumer.failure_isolation == "transaction"
            and not processor.consumer.asynchronous
            and not opted_out
            and type(processor.store) is SqlClaimStore
            and isinstance(bind, Engine)
            and bind.dialect.name == "postgresql"
            and bind.dialect.driver == "psycopg"
            # The Session must join the connection's transaction without committing it.
            and joins in ("conservative_savepoint", "rollback_only")
            and not sessions.kw.get("binds")
            # Listeners of the engine's begin / commit expect them once per message.
            and not any(getattr(bind.dispatch, name) for name in _ENGINE_TRANSACTION_EVENTS)
        )

    def lease(self) -> LeanLease:
        """A connection for a run of single-message transactions."""
        return LeanLease(self.engine, self.sessions)

    def run(
        self, delivery: Delivery[Any], lease: LeanLease, following: Delivery[Any] | None
    ) -> Outcome:
        """One message in its own transaction on ``lease``; a handler failure rolls
        back only it. ``following``: the message to claim with this one's commit.
        Errors outside the handler close the lease and propagate."""
        try:
            return self._run(delivery, lease, following)
        except _WriteAtOnceError as failed:
            log.info(
                "the message's deferred writes or commit failed; running it again with "
                "its writes made at once",
                extra={
                    "consumer": self.name,
                    "message_id": delivery.message.id,
                    "error": f"{type(failed.error).__name__}: {failed.error}",
                },
            )
            return self.fallback(delivery)
        except BaseException as error:
            lease.close()  # e.g. a dead connection: the retry starts on a fresh one
            if not isinstance(error, Exception) or is_transient(error):
                raise
            if not is_data_error(error):
                raise
            # Its own data, outside the handler (e.g. its claim refused by a trigger).
            self.p.log_failure(delivery, error)
            return Outcome(failures=[(delivery, error)])

    # -- one transaction -----------------------------------------------------------------

    def _run(
        self, delivery: Delivery[Any], lease: LeanLease, following: Delivery[Any] | None
    ) -> Outcome:
        session, connection, cursor = lease.open()
        metrics = self.p.metrics
        message_id = str(delivery.message.id)
        outcome = Outcome()
        started = time.monotonic()
        new = lease.take_claim(message_id)
        if new is not None:
            pass  # claimed with the previous message's commit
        elif self.consumer.deduplicate:
            new = cursor.send(self._begin_sql, (self.name, message_id, _now())).ntuples > 0
            metrics.histograms.observe("claim_seconds", time.monotonic() - started)
        else:
            cursor.send("BEGIN")
            new = True
        try:
            tail: list[tuple[str, tuple[Any, ...]]] = []
            if new:
                result = self._handle(session, connection, delivery, tail, outcome)
                if isinstance(result, Exception):
                    return outcome  # rolled back
                if result is not None:
                    outcome.results[message_id] = result
                    if self.consumer.deduplicate:
                        stored = self._dump_result(result)
                        tail.append((self._result_sql, (stored, self.name, message_id)))
            else:
                outcome.duplicates.append(delivery)
                if self.consumer.wants_duplicate_results:
                    outcome.stored_results = self.p.store.results(session, self.name, [message_id])
            _end_orm_transaction(session, connection, commit=True)  # sends nothing
            lease.claimed = self._commit(cursor, tail, message_id, self._next_id(following))
        except BaseException:
            _rollback(session, connection)
            raise
        finally:
            if session.identity_map:
                session.expunge_all()  # the next message starts with an empty session
        self.p.last_commit = time.monotonic()
        metrics.histograms.observe("transaction_seconds", self.p.last_commit - started)
        return outcome

    def _handle(
        self,
        session: Session,
        connection: Connection,
        delivery: Delivery[Any],
        tail: list[tuple[str, tuple[Any, ...]]],
        outcome: Outcome,
    ) -> Any:
        """Run the handler with its plain inserts deferred into ``tail``; its result, or
        the exception it raised (the transaction then rolled back, the failure in
        ``outcome``)."""
        deferred = open_deferral(session, connection) if self.defer else None
        guard_session(session)
        namespace = session.__dict__
        namespace["connection"] = functools.partial(_connection_of, session, connection)
        if deferred is not None:
            namespace["execute"] = deferred.execute
            deferred.enter_handler()
        try:
            value = self.p.handlers.call(session, delivery)
            session.flush()
            if deferred is not None and deferred.failed is not None:
                raise deferred.failed  # the handler caught it
        except Exception as error:
            if deferred is not None and deferred.failed is not None:
                self._reading_across_handlers(deferred.failed)
                raise _WriteAtOnceError(deferred.failed) from error
            if is_transient(error):
                raise
            _rollback(session, connection)
            self.p.log_failure(delivery, error)
            outcome.failures.append((delivery, error))
            return error
        finally:
            unguard_session(session)
            namespace.pop("execute", None)
            namespace.pop("connection", None)
            if deferred is not None:
                deferred.leave_handler()
                close_deferral(deferred)
        outcome.processed.append(delivery)
        if deferred is not None:
            self._take_writes(deferred, connection.dialect, tail)
        return value

    def _take_writes(
        self, deferred: DeferredWrites, dialect: Dialect, tail: list[tuple[str, tuple[Any, ...]]]
    ) -> None:
        """Move the deferred plain inserts into ``tail``; write any other queue now."""
        rows = deferred.take_plain_inserts()
        statements = None
        if rows is not None:
            statements = [(_values_sql(table, tuple(row), dialect), row) for table, row in rows]
        if statements is None or any(sql is None for sql, _ in statements):
            try:
                if rows is not None:  # written through SQLAlchemy, in order
                    for table, row in rows:
                        deferred.connection.execute(table.insert().inline(), row)
                deferred.flush()
            except Exception as error:
                if is_transient(error):
                    raise
                raise _WriteAtOnceError(error) from error
            return
        for sql, row in statements:
            assert sql is not None
            tail.append((sql, tuple(row.values())))

    def _next_id(self, following: Delivery[Any] | None) -> str | None:
        """The id to claim with this commit (None: no next message, or no claim to
        tell afterwards whether this commit ran, or stopping)."""
        if following is None or not self.consumer.deduplicate or self.p.stop.requested:
            return None
        return str(following.message.id)

    def _commit(
        self,
        cursor: Wire,
        tail: list[tuple[str, tuple[Any, ...]]],
        message_id: str,
        next_id: str | None,
    ) -> tuple[str, bool] | None:
        """The tail's statements, COMMIT and the next message's claim in one query;
        returns the next message's claim (None: not claimed)."""
        statements = [sql for sql, _ in tail]
        statements.append("COMMIT")
        params = [value for _, values in tail for value in values]
        if next_id is not None:
            statements.append(self._begin_sql)
            params += (self.name, next_id, _now())
        try:
            result = cursor.send("; ".join(statements), params)
        except Exception as error:
            if is_transient(error):
                raise
            cursor.driver.rollback()
            if next_id is None or not self._committed(cursor, message_id):
                raise _WriteAtOnceError(error) from error
            # This message committed; the next one's claim failed: it claims again.
            return None
        if next_id is None:
            return None
        return next_id, result.ntuples > 0

    def _committed(self, cursor: Wire, message_id: str) -> bool:
        """Whether ``message_id``'s claim has committed (asked outside a transaction)."""
        return cursor.send(self._committed_sql, (self.name, message_id)).ntuples > 0

    def _reading_across_handlers(self, error: Exception) -> None:
        if isinstance(error, DeferredResultUnavailableError) and self.defer:
            self.defer = False
            log.info(
                "a handler reads results of writes across handler calls: this "
                "consumer's writes are executed at once from now on",
                extra={"consumer": self.name},
            )


def _same(value: Any) -> Any:
    return value


def _now() -> str:
    """The claim time, as text (bound as a literal: cheaper than a datetime)."""
    return utcnow().isoformat()


def _connection_of(session: Session, connection: Connection, *args: Any, **kwargs: Any) -> Any:
    """``ctx.session.connection()`` in the handler: the transaction's connection,
    without beginning a Session transaction (nothing ORM to commit for driver SQL)."""
    if args or kwargs:
        return Session.connection(session, *args, **kwargs)
    return connection


def _driver(connection: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``connection``."""
    driver = connection.connection.driver_connection
    assert driver is not None
    return cast("psycopg.Connection[Any]", driver)


def _rollback(session: Session, connection: Connection) -> None:
    """End the transaction begun by hand, then the ORM's view of it."""
    driver = _driver(connection)
    if not driver.closed:
        driver.rollback()  # ROLLBACK when the server is in a transaction
    _end_orm_transaction(session, connection, commit=False)


def _end_orm_transaction(session: Session, connection: Connection, *, commit: bool) -> None:
    """End the Session's transaction without ending the server's.

    The connection keeps a standing SQLAlchemy transaction (:func:`_standing`): the
    Session joins it and its commit is not passed on to the connection, so SQLAlchemy
    never sends a COMMIT of its own (the server's transaction is ended by this module,
    and may already be the next message's). A Session rollback is passed on; it comes
    after the server's ROLLBACK, when psycopg has nothing to send.
    """
    if commit:
        if session.in_transaction() or notify_pending(session):
            session.commit()  # a pending outbox NOTIFY is sent in the transaction
    elif session.in_transaction():
        session.rollback()
    transaction = connection.get_transaction()
    if commit and (transaction is None or not transaction.is_active):
        # Ending SQLAlchemy's transaction now would end the server's: not this way.
        raise _WriteAtOnceError(RuntimeError("SQLAlchemy ended the connection's transaction"))
    _standing(connection)


def _standing(connection: Connection) -> None:
    """Give ``connection`` an active SQLAlchemy transaction (in driver autocommit it
    sends nothing), which a Session joins without ever committing it."""
    transaction = connection.get_transaction()
    if transaction is not None and transaction.is_active:
        return
    if transaction is not None:
        transaction.rollback()
    connection.begin()


@functools.lru_cache(maxsize=256)
def _values_sql(table: Table, keys: tuple[str, ...], dialect: Dialect) -> str | None:
    """``INSERT INTO table (keys) VALUES (%s, …)``; None when SQLAlchemy must write the
    row: a key that is no column, a column type with bind processing (JSON, Enum, …),
    a client-side default of a column the row leaves out, a ``%`` in a name."""
    columns = []
    for key in keys:
        column = table.c.get(key)
        if column is None or column.type._cached_bind_processor(dialect) is not None:
            return None
        columns.append(column)
    if any(column.key not in keys and column.default is not None for column in table.c):
        return None
    prepare = dialect.identifier_preparer
    names = ", ".join(prepare.format_column(column) for column in columns)
    values = ", ".join(["%s"] * len(keys))
    sql = f"INSERT INTO {prepare.format_table(table)} ({names}) VALUES ({values})"
    return None if sql.count("%") != len(keys) else sql
