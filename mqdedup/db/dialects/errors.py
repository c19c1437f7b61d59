"""Which database errors are which, decided by SQLSTATE / driver error code / exception
class, never by the text of a message: *transient* ones (retry the transaction, never
dead-letter), contention, pool and pooler timeouts, driver limits, errors that belong to
the data of one message (:func:`is_data_error`), unique-key violations."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from sqlalchemy import exc as sa_exc

# SQLSTATE classes and codes that mean "try the transaction again".
_TRANSIENT_SQLSTATE_CLASSES = ("08",)  # connection exception
_TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "53300",  # too_many_connections
        "53400",  # configuration_limit_exceeded
    }
)
_SQLITE_TRANSIENT_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
# MySQL/MariaDB: lock wait timeout, deadlock, server gone / lost / cannot connect,
# too many connections, server shutdown, connection killed (MariaDB 1927, MySQL 4031).
_MYSQL_TRANSIENT_CODES = frozenset({1205, 1213, 2002, 2003, 2006, 2013, 1040, 1053, 1927, 4031})
# Transient errors of a database that answers (contention): serialization failure,
# deadlock, lock not available; MySQL lock wait timeout and deadlock.
_CONTENTION_SQLSTATES = frozenset({"40001", "40P01", "55P03"})
_MYSQL_CONTENTION_CODES = frozenset({1205, 1213})
_MYSQL_DUPLICATE_KEY = 1062  # ER_DUP_ENTRY
MYSQL_LOCK_WAIT_TIMEOUT = 1205  # ER_LOCK_WAIT_TIMEOUT
_PG_UNIQUE_VIOLATION = "23505"
# SQLITE_CONSTRAINT_PRIMARYKEY, SQLITE_CONSTRAINT_UNIQUE (extended result codes).
_SQLITE_UNIQUE_CODES = frozenset({1555, 2067})
# SQLSTATE classes of errors caused by the values of a statement: data exception,
# integrity constraint violation.
_DATA_SQLSTATE_CLASSES = ("22", "23")
# SQLite primary result codes for the same: SQLITE_TOOBIG, SQLITE_CONSTRAINT,
# SQLITE_MISMATCH, SQLITE_RANGE (extended codes carry the primary one in the low byte).
_SQLITE_DATA_CODES = frozenset({18, 19, 20, 25})
_SQLITE_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
# MySQL/MariaDB: bad null, duplicate key, data too long, out of range, wrong value,
# truncated, incorrect string value (encoding), foreign keys, check constraints.
_MYSQL_DATA_CODES = frozenset(
    {1048, 1062, 1264, 1265, 1292, 1366, 1367, 1406, 1451, 1452, 1690, 3819, 4025}
)


def is_transient(error: BaseException) -> bool:
    """True when ``error`` *looks* like an infrastructure failure worth retrying the
    transaction for.

    A client-side driver limit (:func:`driver_limit`) is never transient. Whether an
    error that looks like the database not answering really is an outage is decided by
    a probe (:mod:`mqdedup.db.probe`, :class:`mqdedup.outages.Outages`); contention
    (:func:`is_contention`) is retried without one.
    """
    if isinstance(error, sa_exc.DBAPIError):
        if error.connection_invalidated:
            return True
        if driver_limit(error) is not None:
            return False
        return _is_transient_driver_error(error.orig)
    if isinstance(error, sa_exc.TimeoutError | sa_exc.DisconnectionError):
        return True  # pool checkout timed out / disconnect detected by the pool
    if _is_transient_driver_error(error):
        return True
    # A framework's wrapper of the driver's error (Django's OperationalError from an ORM
    # call in a handler) carries it as its cause.
    cause = error.__cause__
    return (
        cause is not None
        and not isinstance(cause, sa_exc.DBAPIError)
        and (_is_transient_driver_error(cause))
    )


def _is_transient_driver_error(orig: BaseException | None) -> bool:
    if orig is None:
        return False
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate in _TRANSIENT_SQLSTATES or sqlstate.startswith(_TRANSIENT_SQLSTATE_CLASSES)
    module = type(orig).__module__
    if module.startswith("psycopg"):
        # No SQLSTATE: the error never reached the server (refused, reset, timed out).
        import psycopg  # lazy: the postgresql extra (only reached with a psycopg error)

        return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", None) in _SQLITE_TRANSIENT_CODES
    if module.startswith("pymysql"):
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        return len(args) > 0 and args[0] in _MYSQL_TRANSIENT_CODES
    return False


def is_contention(error: BaseException) -> bool:
    """True for a transient error of a database that answers: a deadlock, a
    serialization failure, a lock wait that timed out, SQLite's busy / locked. Retried
    at once with backoff; no probe is needed to know the database is there."""
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    if orig is None:
        return False
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate in _CONTENTION_SQLSTATES
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", None) in _SQLITE_TRANSIENT_CODES
    if type(orig).__module__.startswith("pymysql"):
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        return len(args) > 0 and args[0] in _MYSQL_CONTENTION_CODES
    return False


def is_pool_timeout(error: BaseException) -> bool:
    """True when SQLAlchemy's pool gave no connection within its timeout (every one of
    its connections checked out): the process exhausted its pool, the database may be
    perfectly well."""
    return isinstance(error, sa_exc.TimeoutError)


#: PgBouncer ends a client's wait for a server connection with this error (SQLSTATE
#: 08P01, the protocol-violation code it uses for all of its own errors; the reason is
#: its documented setting name, the only thing that tells the queue timeout apart).
PGBOUNCER_QUERY_WAIT_TIMEOUT = "query_wait_timeout"


def is_pooler_queue_timeout(error: BaseException) -> bool:
    """True when a pooler in front of PostgreSQL (PgBouncer) gave up waiting for a free
    server connection (``query_wait_timeout``): its server pool is too small for what
    is asked of it, the database itself answers.

    PgBouncer sends SQLSTATE 08P01 with its reason ``query_wait_timeout`` as the primary
    message and no code of its own, so the code AND that exact reason decide (the one
    place a message text is read; duplicates are never recognised that way).
    """
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    if getattr(orig, "sqlstate", None) != "08P01":
        return False
    diag = getattr(orig, "diag", None)
    return getattr(diag, "message_primary", None) == PGBOUNCER_QUERY_WAIT_TIMEOUT


#: The most parameters one statement may carry (psycopg 3 / libpq: a 16-bit count).
PSYCOPG_MAX_PARAMETERS = 65_535


def driver_limit(error: BaseException) -> str | None:
    """The reason when the driver refused a statement on the client side for a limit
    that the statement's values exceed (it never reached the database); else None.

    psycopg refuses a statement with more than 65,535 parameters with an
    ``OperationalError`` without SQLSTATE, the class it also uses for a lost connection;
    told apart by structure, not text: the connection is still valid (SQLAlchemy did not
    invalidate it) and the statement carried more parameters than the protocol allows.
    Such an error belongs to the message whose statement it was.
    """
    if not isinstance(error, sa_exc.DBAPIError) or error.connection_invalidated:
        return None
    orig = error.orig
    if orig is None or getattr(orig, "sqlstate", None):
        return None
    if not type(orig).__module__.startswith("psycopg"):
        return None
    params = error.params
    count = len(params) if isinstance(params, Mapping | tuple) else 0
    if count <= PSYCOPG_MAX_PARAMETERS:
        return None
    return (
        f"statement has {count:,} parameters; psycopg allows {PSYCOPG_MAX_PARAMETERS:,}: "
        "write the rows in chunks (several statements, or ctx.stage / an ORM bulk insert, "
        "which SQLAlchemy pages), or pass the values as arrays (unnest)"
    )


def is_data_error(error: BaseException) -> bool:
    """True when ``error`` was caused by the values a statement carried, not the database.

    Data exceptions and integrity violations (SQLSTATE classes 22 and 23, SQLite's
    constraint / mismatch / too-big codes, the MySQL codes for the same) and text the
    driver cannot encode (``UnicodeError``, e.g. a lone surrogate). Decided by code and
    class along the exception's cause chain, never by the text of the message. Such an
    error belongs to one message: it fails that message, never its batch or the worker.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, UnicodeError) or _is_data_driver_error(current):
            return True
        if isinstance(current, sa_exc.DBAPIError):
            return _is_data_driver_error(current.orig) or driver_limit(current) is not None
        current = current.__cause__ or current.__context__
    return False


def _is_data_driver_error(orig: BaseException | None) -> bool:
    if orig is None:
        return False
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate.startswith(_DATA_SQLSTATE_CLASSES)
    module = type(orig).__module__
    if module.startswith("psycopg"):
        # Refused by psycopg before it reached the server (no SQLSTATE), e.g. a NUL
        # byte in a text parameter: psycopg raises the class of SQLSTATE class 22.
        import psycopg  # lazy: the postgresql extra (only reached with a psycopg error)

        return isinstance(orig, psycopg.DataError | psycopg.IntegrityError)
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        return isinstance(code, int) and (code & 0xFF) in _SQLITE_DATA_CODES
    if module.startswith("pymysql"):
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        return len(args) > 0 and args[0] in _MYSQL_DATA_CODES
    return False


def is_sqlite_lock_error(error: BaseException) -> bool:
    """True for SQLite's "database is locked" / "table is locked" (SQLITE_BUSY, _LOCKED)."""
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    if not isinstance(orig, sqlite3.Error):
        return False
    code = getattr(orig, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in _SQLITE_BUSY_CODES


def mysql_code(error: sa_exc.DBAPIError) -> Any:
    args: tuple[Any, ...] = tuple(getattr(error.orig, "args", ()))
    return args[0] if args else None


def is_unique_violation(error: BaseException) -> bool:
    """True when ``error`` is a primary-key / unique-index violation (by code, not text)."""
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    if orig is None:
        return False
    if getattr(orig, "sqlstate", None) == _PG_UNIQUE_VIOLATION:
        return True
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", None) in _SQLITE_UNIQUE_CODES
    if type(orig).__module__.startswith("pymysql"):
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        return len(args) > 0 and args[0] == _MYSQL_DUPLICATE_KEY
    return False
