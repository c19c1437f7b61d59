"""Is the consumer's transaction still the one the framework began, and still healthy?

A handler can leave the processor's transaction in a state no exception reports: it
catches a database error without a savepoint (PostgreSQL then refuses every later
statement), or it ends the transaction by a route the session guard does not cover
(``session.connection().commit()``, ``session.get_transaction().commit()``,
``execute(text("COMMIT"))``, DDL that MariaDB and MySQL commit implicitly). The
framework checks after every handler and before every commit; :class:`TransactionWatch`
is that check.

What it reads, all of it already known on the client (no round trip):

* SQLAlchemy: the Session's root transaction and the Connection's transaction, taken
  when the watch begins, are still ``is_active`` (a ``commit()`` or ``rollback()``
  through any SQLAlchemy object ends one of them for good, even when a new one has
  begun since);
* the driver's own transaction state before every statement (a dialect event that only
  reads it, installed once per engine by :func:`watch_engine`): psycopg's
  ``Connection.info.transaction_status`` (``INTRANS``, ``INERROR``, ``IDLE``); PyMySQL's
  ``Connection.server_status``, the server status flags of the last OK packet
  (``SERVER_STATUS_IN_TRANS``, cleared by a ``COMMIT``, a ``ROLLBACK`` or an implicit
  commit; PyMySQL refreshes it from OK packets only, so it is read only right after a
  statement without a result set); ``sqlite3.Connection.in_transaction``. A
  transaction seen open that a statement left closed was ended by that statement, even
  when the next statement would silently begin a new one: that next statement is
  refused with :class:`HandlerBrokeTransactionError` (nothing runs outside the
  transaction), and the handler's last statement is checked when it returns.

Drivers that say nothing (other DBAPIs) get the SQLAlchemy checks only. A statement
run on the raw driver connection, bypassing SQLAlchemy, is seen only by the state at the
end of the handler (on PostgreSQL and SQLite; not at all on MariaDB). Cost: about a
microsecond per statement, a few per handler; no statement of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import ExceptionContext, ExecutionContext
from sqlalchemy.orm import Session

#: The watches in force, by ``id()`` of their Connection (read before every statement:
#: cheaper than ``Connection.info``; empty when no handler runs).
_WATCHES: dict[int, TransactionWatch] = {}


class HandlerBrokeTransactionError(RuntimeError):
    """A handler left the processor's transaction aborted or ended.

    It caught a database error without a savepoint (PostgreSQL then refuses every later
    statement of the transaction), or it ended the transaction by a route the guard
    cannot refuse (``execute(text("COMMIT"))``, DDL that MariaDB commits implicitly, the
    transaction objects' ``commit()``). The statement after one that ended the
    transaction is refused with it; the rest is found when the handler returns. The
    message fails alone (its batch-mates keep their writes and claims), is retried and
    then dead-lettered with a reason naming the cause and the fix.
    """


class State(enum.Enum):
    """A driver's view of its connection's transaction."""

    OPEN = "open"
    ABORTED = "aborted"  # PostgreSQL: a statement failed, every later one is refused
    NONE = "none"  # no transaction (ended, or not begun yet)
    UNKNOWN = "unknown"  # the driver does not say


class Breakage(enum.Enum):
    """How a handler left the transaction."""

    ABORTED = "aborted"  # still open, but refusing statements: roll back (to a savepoint)
    ENDED = "ended"  # committed, rolled back or replaced by another: nothing to roll back to


@dataclass(frozen=True)
class Broken:
    """What the check found: how the transaction broke, and a reason naming cause and fix."""

    kind: Breakage
    reason: str


# -- the drivers' transaction states ----------------------------------------------------

#: ``probe(driver, cursor)``: the state after the statement of ``cursor`` (None: now).
_Probe = Callable[[Any, Any], State]

#: PostgreSQL (libpq) transaction statuses, as psycopg's ``pq.TransactionStatus``.
_PG_IDLE, _PG_ACTIVE, _PG_INTRANS, _PG_INERROR = 0, 1, 2, 3
#: MySQL/MariaDB ``SERVER_STATUS_IN_TRANS`` (include/mysql_com.h), as PyMySQL's
#: ``constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS``.
_MYSQL_IN_TRANS = 1


def _psycopg(driver: Any, _cursor: Any) -> State:
    # ``pgconn`` (psycopg's documented libpq wrapper) gives libpq's status as an int;
    # ``info.transaction_status`` builds a ConnectionInfo and an enum on every read.
    status = driver.pgconn.transaction_status
    if status == _PG_INTRANS:
        return State.OPEN
    if status == _PG_INERROR:
        return State.ABORTED
    if status == _PG_IDLE:
        return State.NONE
    return State.UNKNOWN  # ACTIVE (a query running: never between statements), UNKNOWN


def _pymysql(driver: Any, cursor: Any) -> State:
    # PyMySQL refreshes ``server_status`` from OK packets only: it is exact right after a
    # statement without a result set (DML, DDL, COMMIT), stale after one with.
    if cursor is None or cursor.description is not None:
        return State.UNKNOWN
    return State.OPEN if driver.server_status & _MYSQL_IN_TRANS else State.NONE


def _sqlite(driver: Any, _cursor: Any) -> State:
    return State.OPEN if driver.in_transaction else State.NONE


def _unknown(_driver: Any, _cursor: Any) -> State:
    return State.UNKNOWN


_PROBES: dict[type[Any], _Probe] = {}


def _probe_for(driver: Any) -> _Probe:
    """How to read ``driver``'s transaction state (resolved once per driver class)."""
    kind = type(driver)
    probe = _PROBES.get(kind)
    if probe is None:
        info = getattr(driver, "info", None)
        if hasattr(info, "transaction_status"):  # psycopg 3, sync and async
            probe = _psycopg
        elif isinstance(getattr(driver, "server_status", None), int):  # PyMySQL
            probe = _pymysql
        elif isinstance(getattr(driver, "in_transaction", None), bool):  # sqlite3, aiosqlite
            probe = _sqlite
        else:
            probe = _unknown
        _PROBES[kind] = probe
    return probe


# -- the watch ----------------------------------------------------------------------------


class TransactionWatch:
    """Watches one transaction of ``session`` while the handlers run.

    Built right before the handlers (after the claim), closed before the framework ends
    the transaction itself. :meth:`check` after each handler and before the commit.
    """

    __slots__ = (
        "_driver",
        "_last_cursor",
        "_probe",
        "aborted_by",
        "connection",
        "connection_transaction",
        "ended_by",
        "last_statement",
        "opened",
        "root",
        "session",
    )

    def __init__(
        self, session: Session, connection: Connection | None = None, *, begun: bool = False
    ) -> None:
        self.session = session
        self.root = session.get_transaction()
        self.connection = session.connection() if connection is None else connection
        self.connection_transaction = self.connection.get_transaction()
        self._driver = self.connection.connection.driver_connection
        self._probe = _probe_for(self._driver)
        #: The transaction is known to be open on the server (``begun``: a claim ran in
        #: it); only then does "no transaction" mean that it was ended.
        self.opened = begun or self._probe(self._driver, None) is State.OPEN
        #: The statement after which the driver saw the open transaction gone.
        self.ended_by: str | None = None
        #: The last statement run on the connection, and its cursor (PyMySQL's status
        #: is exact only after a statement without a result set).
        self.last_statement: str | None = None
        self._last_cursor: Any = None
        #: The first database error since the last statement that succeeded: on
        #: PostgreSQL the one that aborted the transaction (a caught one names the cause).
        self.aborted_by: BaseException | None = None
        _WATCHES[id(self.connection)] = self

    def close(self) -> None:
        """Stop watching (the framework is about to end the transaction)."""
        _WATCHES.pop(id(self.connection), None)

    def before(self, statement: str, cursor: Any) -> None:
        """Before each statement on the connection: the state the previous one left.

        A transaction seen open that the previous statement left closed was ended by it:
        this statement is refused (HandlerBrokeTransactionError), so nothing the handler
        runs next lands outside the transaction (or, on SQLite with SQLAlchemy's
        ``BEGIN``, autocommits).
        """
        state = self._probe(self._driver, self._last_cursor)
        if state is State.OPEN:
            self.opened = True
            self.aborted_by = None  # the previous statement succeeded: nothing is aborted
        elif state is State.NONE and self.opened and self.last_statement is not None:
            if self.ended_by is None:
                self.ended_by = self.last_statement
            raise HandlerBrokeTransactionError(_statement_reason(self.last_statement))
        self.last_statement = statement
        self._last_cursor = cursor

    def caught(self, raised: BaseException) -> bool:
        """True when the transaction was aborted by an error the handler did not let
        out: neither ``raised`` nor its cause or context (``raise Mine(...) from error``
        lets it out). The handler caught that one and went on; ``raised`` is then, say,
        PostgreSQL's "current transaction is aborted"."""
        aborted_by = self.aborted_by
        if aborted_by is None:
            return False
        seen: set[int] = set()
        error: BaseException | None = raised
        while error is not None and id(error) not in seen:
            if error is aborted_by:
                return False
            seen.add(id(error))
            error = error.__cause__ or error.__context__
        return True

    def check(self) -> Broken | None:
        """None while the transaction is the framework's and healthy; else what broke."""
        # A transaction object, once ended, never becomes active again: a commit or a
        # rollback through any SQLAlchemy object ends one of these two for good.
        root = self.root
        if root is None or not root.is_active:
            return Broken(Breakage.ENDED, _ended_reason("the session's transaction"))
        transaction = self.connection_transaction
        if transaction is None or not transaction.is_active:
            return Broken(Breakage.ENDED, _ended_reason("the connection's transaction"))
        if self.ended_by is not None:
            return Broken(Breakage.ENDED, _statement_reason(self.ended_by))
        state = self._probe(self._driver, self._last_cursor)
        if state is State.ABORTED:
            return Broken(Breakage.ABORTED, _aborted_reason(self.aborted_by))
        if state is State.NONE and self.opened:
            if self.last_statement is not None:  # the handler's last statement ended it
                self.ended_by = self.last_statement
                return Broken(Breakage.ENDED, _statement_reason(self.last_statement))
            return Broken(Breakage.ENDED, _ended_reason("the driver connection's transaction"))
        return None

    def rollback_driver(self) -> None:
        """Roll back whatever transaction the driver connection has open now (one the
        handler began after ending the framework's, say)."""
        self.connection.connection.dbapi_connection.rollback()  # type: ignore[union-attr]


def watch_engine(engine: Engine) -> None:
    """Let :class:`TransactionWatch` see every statement on ``engine``'s connections.

    Dialect events (installed once): before each statement, the driver's transaction
    state is read (a few attribute reads, only on a connection being watched); the
    statement then runs as usual, unchanged. Dialect events, unlike the Connection's
    cursor events, leave SQLAlchemy's execution path as it is (about 1 µs per statement
    against 5). On each database error (an engine event, called on errors only), the
    error is kept for the reason.
    """
    if not event.contains(engine, "do_execute", _before_statement):
        event.listen(engine, "do_execute", _before_statement)
        event.listen(engine, "do_executemany", _before_statement)
        event.listen(engine, "do_execute_no_params", _before_statement_no_params)
        event.listen(engine, "handle_error", _on_error)


def _before_statement(
    cursor: Any, statement: str, _parameters: Any, context: ExecutionContext
) -> None:
    if _WATCHES:
        watch = _WATCHES.get(id(context.root_connection))
        if watch is not None:
            watch.before(statement, cursor)
    # None: SQLAlchemy executes the statement itself, as it would without this event


def _before_statement_no_params(cursor: Any, statement: str, context: ExecutionContext) -> None:
    _before_statement(cursor, statement, None, context)


def _on_error(context: ExceptionContext) -> None:
    connection = context.connection
    if connection is None:
        return
    watch = _WATCHES.get(id(connection))
    if watch is not None and watch.aborted_by is None:
        watch.aborted_by = context.sqlalchemy_exception or context.original_exception


# -- reasons: the cause and the fix ---------------------------------------------------------

_DO_NOT_END = (
    "a handler must not commit or roll back: mqdedup commits the message's claim and "
    "writes together after the handler (use `with ctx.session.begin_nested():` for a "
    "savepoint of your own)"
)


def _ended_reason(what: str) -> str:
    return f"the handler ended {what} (a commit or rollback): {_DO_NOT_END}"


def _statement_reason(statement: str) -> str:
    text = " ".join(statement.split())
    shown = text if len(text) <= 80 else text[:77] + "..."
    keyword = text.split(" ", 1)[0].upper() if text else ""
    if keyword in {"COMMIT", "ROLLBACK", "END", "ABORT", "BEGIN", "START"}:
        return f"the handler's statement `{shown}` ended the transaction: {_DO_NOT_END}"
    return (
        f"the handler's statement `{shown}` ended the transaction (MariaDB and MySQL commit "
        "implicitly before and after DDL such as CREATE, ALTER, DROP, TRUNCATE, and after "
        "LOCK TABLES): run migrations and DDL outside handlers"
    )


def _aborted_reason(error: BaseException | None) -> str:
    if error is None:
        caught = "caught a database error"
    else:
        original = getattr(error, "orig", None) or error
        first = str(original).strip().splitlines()[0][:160] if str(original).strip() else ""
        caught = f"caught {type(error).__name__}" + (f" ({first})" if first else "")
    return (
        f"the handler {caught} without a savepoint, which left the transaction aborted: "
        "wrap the statement in `with ctx.session.begin_nested():` so that its failure "
        "undoes only itself (or use ctx.insert_or_get for insert-if-absent)"
    )
