"""Everything that differs between databases lives here.

* which errors are *transient* (retry the transaction, never dead-letter), decided by
  SQLSTATE / driver error code / exception class, never by the text of a message;
* the claim statement (``INSERT … ON CONFLICT DO NOTHING RETURNING``; on MySQL/MariaDB
  ``INSERT IGNORE``, see :func:`claim_ids`);
* the attempt-counter upserts (``ON CONFLICT DO UPDATE`` / ``ON DUPLICATE KEY UPDATE``),
  including the conditional one that counts an attempt before it runs;
* how a unique-key violation is recognised (SQLSTATE 23505, SQLite extended codes,
  MySQL error 1062), and the locking read used to see the latest committed row;
* which errors belong to the data of one message (:func:`is_data_error`: SQLSTATE
  classes 22 and 23 and their SQLite / MySQL equivalents, encoding errors), so that they
  fail that message alone and never a batch or a worker;
* for the outbox, the relay and the tools (the second half of this module): what each
  database can do (:func:`traits`: shard locks, ``LISTEN``/``NOTIFY``, a one-statement
  claim, ``LIMIT`` in subqueries), the relay's session settings and transactions, the
  id-list clause, the checks that a relay still holds its shard locks, table sizes.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    Dialect,
    Engine,
    Select,
    Table,
    TextClause,
    and_,
    any_,
    bindparam,
    event,
    null,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from mqdedup.errors import ConfigurationError

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
_MYSQL_LOCK_WAIT_TIMEOUT = 1205  # ER_LOCK_WAIT_TIMEOUT
_PG_UNIQUE_VIOLATION = "23505"
# SQLITE_CONSTRAINT_PRIMARYKEY, SQLITE_CONSTRAINT_UNIQUE (extended result codes).
_SQLITE_UNIQUE_CODES = frozenset({1555, 2067})
MYSQL_DIALECTS = ("mysql", "mariadb")
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
# The key columns are VARCHAR(255) (characters); INSERT IGNORE would truncate longer
# values into a silent collision, so longer ones are refused before any SQL.
_MYSQL_MAX_KEY_LENGTH = 255


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


def client_encoding(connection: Connection) -> str | None:
    """The client encoding the driver uses on ``connection`` (psycopg), None where the
    driver does not say (SQLite, MySQL drivers).

    Read from the driver's own connection info (psycopg reads the server's
    ``ParameterStatus`` of ``client_encoding``): no round trip.
    """
    info = getattr(connection.connection.driver_connection, "info", None)
    encoding = getattr(info, "encoding", None)
    return encoding if isinstance(encoding, str) else None


def claim_ids(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """Insert ``ids`` (already sorted) for ``consumer``; return those that were new.

    One statement per batch. A concurrent transaction holding the same key makes this
    statement wait on the unique index until that transaction ends.
    """
    if not ids:
        return set()
    bind_dialect = session.get_bind().dialect
    dialect = bind_dialect.name
    if dialect == "postgresql":
        if len(ids) == 1:  # one message per transaction: a plain row, no array to unnest
            found = session.connection().exec_driver_sql(
                _pg_claim_one_sql(table.name), (consumer, ids[0], now)
            )
            return {row[0] for row in found}
        # Driver SQL on the session's connection (no ORM statement execution), the ids
        # as a binary array (psycopg quotes and escapes every element of a text one).
        claimed = session.connection().exec_driver_sql(
            _pg_claim_many_sql(table.name, binary=bind_dialect.driver == "psycopg"),
            {"consumer": consumer, "ids": list(ids), "now": now},
        )
        return set(claimed.scalars().all())  # one fetchall, not a fetchone per row
    if dialect == "sqlite":
        insert_stmt = sqlite.insert(table).values(
            [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in ids]
        )
        rows = session.execute(insert_stmt.on_conflict_do_nothing().returning(table.c.message_id))
        return {row[0] for row in rows}
    if dialect in MYSQL_DIALECTS:
        return _claim_ids_mysql(session, table, consumer, ids, now)
    raise NotImplementedError(f"claiming is not implemented for the {dialect!r} database")


@functools.cache
def _pg_claim_many_sql(table_name: str, *, binary: bool) -> str:
    """The batch claim as driver SQL; with psycopg 3 the ids go as a binary ``text[]``
    (``%(ids)b``), other drivers get the ``%(ids)s`` placeholder."""
    ids = "%(ids)b" if binary else "%(ids)s"
    return (
        f"INSERT INTO {table_name} (consumer_name, message_id, processed_at) "
        f"SELECT %(consumer)s, i, %(now)s FROM unnest({ids}::text[]) AS i ORDER BY i "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
    )


@functools.cache
def _pg_claim_one_sql(table_name: str) -> str:
    """The claim of one id, as driver SQL (no statement to compile per transaction)."""
    return (
        f"INSERT INTO {table_name} (consumer_name, message_id, processed_at) "
        "VALUES (%s, %s, %s) "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
    )


def _claim_ids_mysql(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """MySQL / MariaDB claim: ``INSERT IGNORE``, which waits on a concurrent holder.

    InnoDB's duplicate check takes a lock on an existing (even uncommitted) key, so a
    concurrent claim of the same id blocks until the holder commits (→ ignored, a
    duplicate) or rolls back (→ inserted, new), exactly like ``ON CONFLICT DO NOTHING``.

    * MariaDB >= 10.5: one statement, ``INSERT IGNORE … RETURNING message_id``, which
      returns only the rows it inserted.
    * MySQL (no ``RETURNING``): see :func:`_claim_ids_mysql_rowcount`.
    """
    _check_mysql_key(consumer, ids)
    rows = [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in ids]
    insert_ignore = mysql.insert(table).prefix_with("IGNORE")
    bind = session.get_bind()
    if mysql_supports_returning(bind.dialect):
        result = session.execute(insert_ignore.values(rows).returning(table.c.message_id))
        return {row[0] for row in result}
    return _claim_ids_mysql_rowcount(session, table, consumer, ids, now)


def mysql_supports_returning(dialect: Any) -> bool:
    """True for MariaDB >= 10.5 (``INSERT … RETURNING``); MySQL has no ``RETURNING``."""
    return bool(getattr(dialect, "is_mariadb", False) and dialect.insert_returning)


def _claim_ids_mysql_rowcount(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """Claim without ``RETURNING``, deciding every id by an ``INSERT IGNORE`` row count.

    1. A plain (consistent) read drops ids whose claims were committed earlier, the
       common kind of duplicate.
    2. Inside a savepoint, one ``INSERT IGNORE`` of the remaining candidates. If its row
       count equals their number, all of them are new (the usual case: 2 statements).
    3. Otherwise a concurrent transaction committed some of them meanwhile; roll back to
       the savepoint (InnoDB keeps the row locks) and claim the candidates one row at a
       time, each row's count (1 inserted / 0 ignored) saying whether it is new.

    Only step 3's per-row counts and step 2's all-inserted count decide: both come from
    the database's own duplicate check, so the result stays right under concurrency.
    """
    committed = {
        row[0]
        for row in session.execute(
            select(table.c.message_id).where(
                table.c.consumer_name == consumer, table.c.message_id.in_(list(ids))
            )
        )
    }
    candidates = [i for i in ids if i not in committed]
    if not candidates:
        return set()
    insert_ignore = mysql.insert(table).prefix_with("IGNORE")
    rows = [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in candidates]
    savepoint = session.begin_nested()
    inserted = session.execute(insert_ignore.values(rows)).rowcount  # type: ignore[attr-defined]
    if inserted == len(candidates):
        savepoint.commit()
        return set(candidates)
    savepoint.rollback()
    new: set[str] = set()
    for row in rows:
        if session.execute(insert_ignore.values(row)).rowcount == 1:  # type: ignore[attr-defined]
            new.add(str(row["message_id"]))
    return new


def claim_key_nowait(
    session: Session,
    table: Table,
    consumer: str,
    key: str,
    now: datetime,
    *,
    expired_before: datetime | None = None,
) -> str:
    """Claim one key without waiting for a transaction in flight that holds it.

    Returns ``"new"`` (claimed now), ``"taken"`` (claimed by a committed transaction) or
    ``"busy"`` (held by a transaction still in flight; nothing was written). For HTTP
    idempotency keys (:mod:`mqdedup.dedup.request_keys`), where a repeat in flight is
    answered 409 at once instead of waiting on the unique index like a message claim.

    ``expired_before``: a committed claim older than this is claimed again in place
    (``processed_at`` set to ``now``, ``result`` cleared) by one conditional UPDATE in
    this transaction, and the answer is ``"new"``; of two requests reusing an expired
    key at once, one claims it and the other gets ``"busy"``.

    * PostgreSQL: ``pg_try_advisory_xact_lock`` on a 64-bit hash of the key first (held
      until the transaction ends; every claim of the key takes it), so the claim never
      meets an uncommitted row of another transaction. When another transaction holds
      the lock, a committed row means ``taken`` (the holder is another repeat), none
      ``busy``; an expired one ``busy`` too (the holder claims it again). One statement
      (a CTE), no error: the transaction stays usable. The UPDATE of an expired key runs
      only under the lock.
    * MariaDB: the claim (and the UPDATE of an expired key) with
      ``innodb_lock_wait_timeout=0`` for that statement only (``SET STATEMENT … FOR``);
      a lock wait is error 1205 → ``busy``. MySQL (no ``SET STATEMENT``) waits like a
      message claim.
    * SQLite: writers are serialised (``BEGIN IMMEDIATE``), so a key is never held by
      another transaction: the repeat waited for the first one at ``BEGIN``.
    """
    family = traits(session.get_bind()).family
    if family == "postgresql":
        lock = hashlib.sha256(f"{table.name}\x00{consumer}\x00{key}".encode()).digest()[:8]
        row = (
            session.connection()
            .exec_driver_sql(
                _pg_claim_key_sql(table.name),
                (
                    int.from_bytes(lock, "big", signed=True),
                    consumer,
                    key,
                    now,
                    expired_before,
                    consumer,
                    key,
                ),
            )
            .one()
        )
        taken, inserted, committed = row  # committed: None (no row), else "expired?"
        if not taken:
            # Held by a transaction in flight: the first request, a repeat of a key
            # already committed (which only reads it), or one claiming it again.
            return "taken" if committed is False else "busy"
        if inserted:
            return "new"
        if committed and _reclaim(session, table, consumer, key, now, expired_before):
            return "new"
        return "taken"
    # The dialect knows it speaks to MariaDB once connected (a cold engine's first
    # requests would otherwise take the claim that waits).
    dialect = session.connection().dialect
    mariadb = family == "mysql" and getattr(dialect, "is_mariadb", False)
    if expired_before is not None and _expired(session, table, consumer, key, expired_before):
        # Read first (no lock), UPDATE only an expired row: a fresh key's concurrent
        # repeats never lock each other out of their replay.
        try:
            if _reclaim(session, table, consumer, key, now, expired_before, nowait=mariadb):
                return "new"
        except sa_exc.OperationalError as error:
            if mariadb and _mysql_code(error) == _MYSQL_LOCK_WAIT_TIMEOUT:
                return "busy"
            raise
    if mariadb:
        _check_mysql_key(consumer, [key])
        # For this statement only: a key held by a transaction in flight is error 1205 at once.
        statement = text(
            "SET STATEMENT innodb_lock_wait_timeout=0 FOR "
            f"INSERT IGNORE INTO {table.name} (consumer_name, message_id, processed_at) "
            "VALUES (:consumer, :key, :now)"
        )
        try:
            result = session.execute(statement, {"consumer": consumer, "key": key, "now": now})
            inserted = result.rowcount  # type: ignore[attr-defined]
        except sa_exc.OperationalError as error:
            if _mysql_code(error) == _MYSQL_LOCK_WAIT_TIMEOUT:
                return "busy"
            raise
        return "new" if inserted == 1 else "taken"
    return "new" if claim_ids(session, table, consumer, [key], now) else "taken"


def _expired(
    session: Session, table: Table, consumer: str, key: str, expired_before: datetime
) -> bool:
    """True when the key has a committed claim older than ``expired_before`` (no lock)."""
    found = session.execute(
        select(table.c.processed_at).where(
            table.c.consumer_name == consumer,
            table.c.message_id == key,
            table.c.processed_at < expired_before,
        )
    ).first()
    return found is not None


def _reclaim(
    session: Session,
    table: Table,
    consumer: str,
    key: str,
    now: datetime,
    expired_before: datetime | None,
    *,
    nowait: bool = False,
) -> bool:
    """Claim a committed, expired key again in place: True when this UPDATE did."""
    if expired_before is None:
        return False
    if nowait:  # MariaDB: a row locked by another transaction is error 1205 at once
        result = session.execute(
            text(
                "SET STATEMENT innodb_lock_wait_timeout=0 FOR "
                f"UPDATE {table.name} SET processed_at = :now, result = NULL "
                "WHERE consumer_name = :consumer AND message_id = :key AND processed_at < :cutoff"
            ),
            {"now": now, "consumer": consumer, "key": key, "cutoff": expired_before},
        )
    else:
        result = session.execute(
            table.update()
            .where(
                table.c.consumer_name == consumer,
                table.c.message_id == key,
                table.c.processed_at < expired_before,
            )
            .values(processed_at=now, result=null())
        )
    return bool(result.rowcount)  # type: ignore[attr-defined]


@functools.cache
def _pg_claim_key_sql(table_name: str) -> str:
    """One round trip: the key's advisory lock, the claim if locked, a committed row
    (NULL: none; else whether it expired)?"""
    return (
        "WITH lock AS (SELECT pg_try_advisory_xact_lock(%s) AS taken), "
        f"claimed AS (INSERT INTO {table_name} (consumer_name, message_id, processed_at) "
        "SELECT %s, %s, %s FROM lock WHERE taken "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING 1) "
        "SELECT (SELECT taken FROM lock), EXISTS (SELECT 1 FROM claimed), "
        "(SELECT COALESCE(processed_at < %s::timestamptz, false) "
        f"FROM {table_name} WHERE consumer_name = %s AND message_id = %s)"
    )


def _mysql_code(error: sa_exc.DBAPIError) -> Any:
    args: tuple[Any, ...] = tuple(getattr(error.orig, "args", ()))
    return args[0] if args else None


def _check_mysql_key(consumer: str, ids: Sequence[str]) -> None:
    if len(consumer) > _MYSQL_MAX_KEY_LENGTH:
        raise ValueError(
            f"consumer name longer than {_MYSQL_MAX_KEY_LENGTH} characters: {consumer[:40]!r}…"
        )
    for message_id in ids:
        if len(message_id) > _MYSQL_MAX_KEY_LENGTH:
            raise ValueError(
                f"message id longer than {_MYSQL_MAX_KEY_LENGTH} characters: {message_id[:40]!r}…"
            )


def increment_attempts(
    session: Session, table: Table, consumer: str, message_id: str, error: str, now: datetime
) -> int:
    """Add one failed attempt for a message and return the total so far."""
    dialect = session.get_bind().dialect.name
    values: dict[str, Any] = {
        "consumer_name": consumer,
        "message_id": message_id,
        "attempts": 1,
        "last_error": error,
        "updated_at": now,
    }
    if dialect in ("postgresql", "sqlite"):
        module: Any = postgresql if dialect == "postgresql" else sqlite
        insert_stmt = module.insert(table).values(values)
        upsert = insert_stmt.on_conflict_do_update(
            index_elements=[table.c.consumer_name, table.c.message_id],
            set_={
                "attempts": table.c.attempts + 1,
                "last_error": insert_stmt.excluded.last_error,
                "updated_at": insert_stmt.excluded.updated_at,
            },
        ).returning(table.c.attempts)
        return int(session.execute(upsert).scalar_one())
    if dialect in MYSQL_DIALECTS:
        mysql_insert = mysql.insert(table).values(values)
        session.execute(
            mysql_insert.on_duplicate_key_update(
                attempts=table.c.attempts + 1,
                last_error=mysql_insert.inserted.last_error,
                updated_at=mysql_insert.inserted.updated_at,
            )
        )
        # Our upsert holds the row's lock until commit: this read sees our own count.
        counted = session.execute(
            select(table.c.attempts).where(
                table.c.consumer_name == consumer, table.c.message_id == message_id
            )
        )
        return int(counted.scalar_one())
    raise NotImplementedError(f"attempt counting is not implemented for the {dialect!r} database")


def start_attempt(
    session: Session,
    table: Table,
    consumer: str,
    message_id: str,
    marker: str,
    max_attempts: int,
    now: datetime,
) -> tuple[int, str | None, bool]:
    """Count one more attempt *before* it runs, unless ``max_attempts`` is reached.

    Returns ``(attempts, last_error, started)``: with ``started`` the count includes
    the attempt about to run and ``last_error`` is ``marker`` (it stays so until the
    attempt's outcome is recorded); otherwise nothing was written and the row's stored
    count and last error are returned. PostgreSQL and SQLite: one conditional upsert
    (plus a read only when the limit was reached); MySQL/MariaDB: a locking read, then
    the upsert.
    """
    dialect = session.get_bind().dialect.name
    key = (table.c.consumer_name == consumer, table.c.message_id == message_id)
    if dialect in ("postgresql", "sqlite"):
        module: Any = postgresql if dialect == "postgresql" else sqlite
        insert_stmt = module.insert(table).values(
            consumer_name=consumer,
            message_id=message_id,
            attempts=1,
            last_error=marker,
            updated_at=now,
        )
        upsert = insert_stmt.on_conflict_do_update(
            index_elements=[table.c.consumer_name, table.c.message_id],
            set_={
                "attempts": table.c.attempts + 1,
                "last_error": insert_stmt.excluded.last_error,
                "updated_at": insert_stmt.excluded.updated_at,
            },
            where=table.c.attempts < max_attempts,
        ).returning(table.c.attempts)
        counted = session.execute(upsert).scalar_one_or_none()
        if counted is not None:
            return int(counted), marker, True
        stored = session.execute(select(table.c.attempts, table.c.last_error).where(*key)).one()
        return int(stored.attempts), stored.last_error, False
    if dialect in MYSQL_DIALECTS:
        row = session.execute(
            select(table.c.attempts, table.c.last_error).where(*key).with_for_update()
        ).first()
        if row is not None and row.attempts >= max_attempts:
            return int(row.attempts), row.last_error, False
        counted = increment_attempts(session, table, consumer, message_id, marker, now)
        return counted, marker, True
    raise NotImplementedError(f"attempt counting is not implemented for the {dialect!r} database")


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


def latest_committed(statement: Select[Any]) -> Select[Any]:
    """``statement`` made to read the latest committed row version, not a snapshot.

    After a conditional ``UPDATE`` matched no row, the follow-up read must see what
    made it fail. A plain read may serve an older snapshot (MySQL/MariaDB's default
    REPEATABLE READ; PostgreSQL's REPEATABLE READ), so it becomes a shared locking read
    (``FOR SHARE`` / ``LOCK IN SHARE MODE``), which waits for a concurrent writer and
    reads the newest committed version (PostgreSQL above READ COMMITTED raises a
    serialization failure instead, which is transient and retried). SQLite ignores it:
    its writers are serialised already.
    """
    return statement.with_for_update(read=True)


def insert_unless_present(session: Session, table: Table, values: dict[str, Any]) -> None:
    """Insert one row unless it would repeat a unique key (then do nothing).

    ``ON CONFLICT DO NOTHING`` on PostgreSQL and SQLite; a no-op ``ON DUPLICATE KEY
    UPDATE`` on MySQL/MariaDB (``INSERT IGNORE`` would also hide data errors).
    """
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        module: Any = postgresql if dialect == "postgresql" else sqlite
        session.execute(module.insert(table).values(values).on_conflict_do_nothing())
        return
    if dialect in MYSQL_DIALECTS:
        primary = next(iter(table.primary_key.columns))
        statement = mysql.insert(table).values(values)
        session.execute(statement.on_duplicate_key_update({primary.name: primary}))
        return
    raise NotImplementedError(f"insert_unless_present is not implemented for {dialect!r}")


# == The outbox, the relay and the tools (helper sections append below, one per part) ==
#
# What differs between databases for the outbox table, its relay and the operator tools:
# one Traits object per dialect says what a database can do, and the statements and
# session settings that exist on one database only are written here.


@dataclass(frozen=True)
class Traits:
    """What one database can do, as far as the outbox, the relay and the tools care."""

    #: ``postgresql``, ``sqlite`` or ``mysql`` (MySQL and MariaDB alike).
    family: str
    #: How several relays share one outbox table: ``advisory`` locks (PostgreSQL),
    #: ``named`` locks (``GET_LOCK``, MySQL/MariaDB), or ``None`` (SQLite: one relay).
    shard_locks: str | None
    #: ``LISTEN``/``NOTIFY`` wakes the relay when outbox rows commit (else it polls).
    notifies: bool
    #: The claim and its batch lease are one statement (a data-modifying ``WITH``; else a
    #: short transaction of a few statements, :meth:`mqdedup.outbox.store.OutboxStore.claim`).
    claim_in_one_statement: bool
    #: ``LIMIT`` is allowed in an ``IN (…)`` subquery.
    limit_in_subquery: bool
    #: The key columns' collation can drift from the schema's (``db check`` looks).
    key_collation: bool


_POSTGRESQL = Traits(
    family="postgresql",
    shard_locks="advisory",
    notifies=True,
    claim_in_one_statement=True,
    limit_in_subquery=True,
    key_collation=False,
)
_SQLITE = Traits(
    family="sqlite",
    shard_locks=None,
    notifies=False,
    claim_in_one_statement=False,
    limit_in_subquery=True,
    key_collation=False,
)
_MYSQL = Traits(
    family="mysql",
    shard_locks="named",
    notifies=False,
    claim_in_one_statement=False,
    limit_in_subquery=False,
    key_collation=True,
)
_TRAITS = {"postgresql": _POSTGRESQL, "sqlite": _SQLITE, "mysql": _MYSQL, "mariadb": _MYSQL}
SUPPORTED = tuple(_TRAITS)


def traits(bind: Engine | Connection | Dialect) -> Traits:
    """The :class:`Traits` of the database behind ``bind``; ConfigurationError if unknown."""
    dialect = bind if isinstance(bind, Dialect) else bind.dialect
    found = _TRAITS.get(dialect.name)
    if found is None:
        supported = "PostgreSQL, MySQL/MariaDB and SQLite"
        raise ConfigurationError(f"mqdedup supports {supported}, not {dialect.name!r}")
    return found


# PostgreSQL settings of the relay's statements. The planner settings keep the claim on
# the pending index in id order, stopping at the limit, and the update on the primary
# key, even when the statistics still describe an almost empty table (a fresh backlog).
# Leases and marks need no synchronous commit: one lost in a database crash only means a
# row is published again, which the at-least-once contract allows anyway.
_PLANNER = ("enable_sort", "enable_bitmapscan", "enable_hashjoin", "enable_mergejoin")
RELAY_SESSION_SETTINGS = [f"SET {name} = off" for name in _PLANNER] + [
    "SET synchronous_commit = off",
    # Short statements: the planner settings above inflate a small sort's cost estimate
    # past jit_above_cost, and compiling it then took ~500 ms of a 2 ms delete-mark.
    "SET jit = off",
]
#: The same settings for one transaction (a claim on a pooled connection).
CLAIM_SETTINGS = text(
    "; ".join(setting.replace("SET ", "SET LOCAL ") for setting in RELAY_SESSION_SETTINGS)
)
#: For one transaction that marks or releases rows.
MARK_SETTINGS = text("SET LOCAL synchronous_commit = off")


def prepare_relay_connection(connection: Connection) -> Connection:
    """Make ``connection`` a relay connection.

    PostgreSQL: autocommit (each statement is its own short transaction, one round trip)
    with the relay's session settings. MySQL/MariaDB: ``READ COMMITTED`` for the session
    (the claim's locking read then locks only the rows it returns, and no gaps that
    would hold up writers); each store method runs its own transaction on it.

    Detach the connection from the pool afterwards (the settings stay on it).
    """
    if traits(connection).family == "mysql":
        return connection.execution_options(isolation_level="READ COMMITTED")
    connection = connection.execution_options(isolation_level="AUTOCOMMIT")
    for setting in RELAY_SESSION_SETTINGS:
        connection.exec_driver_sql(setting)
    return connection


@contextmanager
def relay_transaction(bind: Engine | Connection, settings: TextClause) -> Iterator[Connection]:
    """A short transaction on an engine or a relay connection.

    On a PostgreSQL relay connection (autocommit) each statement is its own transaction;
    on an engine, ``settings`` (:data:`CLAIM_SETTINGS`, :data:`MARK_SETTINGS`) apply to
    the transaction. On MySQL/MariaDB the transaction runs at ``READ COMMITTED`` (see
    :func:`prepare_relay_connection`; on an engine it is set for this transaction).
    """
    family = traits(bind).family
    if isinstance(bind, Connection):
        if family != "mysql":
            yield bind
            return
        with bind.begin():
            yield bind
        return
    with bind.begin() as connection:
        if family == "postgresql":
            connection.execute(settings)
        elif family == "mysql":
            # Before the transaction's first statement: applies to this transaction only.
            connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        yield connection


def ids_clause(column: Any, dialect: Dialect) -> ColumnElement[bool]:
    """``column`` is one of the ``ids`` parameter (see :func:`ids_params`).

    PostgreSQL: ``= ANY(:ids)`` with one array parameter, plus the ids' range, which lets
    the planner walk the primary key instead of scanning the table (it underestimates
    what ``= ANY(array)`` selects). Elsewhere: ``IN (…)``.
    """
    if traits(dialect).family == "postgresql":
        array = bindparam("ids", type_=ARRAY(BigInteger))
        clause: ColumnElement[bool] = and_(
            column.between(bindparam("low", type_=BigInteger), bindparam("high", type_=BigInteger)),
            column == any_(array),
        )
        return clause
    membership: ColumnElement[bool] = column.in_(bindparam("ids", expanding=True))
    return membership


def ids_params(ids: Sequence[int]) -> dict[str, Any]:
    """The parameters of :func:`ids_clause`."""
    return {"ids": list(ids), "low": min(ids), "high": max(ids)}


#: PostgreSQL: the relay's lock connection (backend ``owner_pid``) still holds the
#: advisory locks ``(lock_class, s)`` of all ``owned`` shards. An uncorrelated subquery
#: of the claim, evaluated once per claim.
ADVISORY_LOCKS_HELD = text(
    "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = CAST(:lock_class AS oid) AND objsubid = 2 AND pid = :owner_pid "
    "AND granted AND objid::bigint = ANY(CAST(:owned AS bigint[]))) = :owned_count"
)


def named_locks_held(connection: Connection, names: Sequence[str], owner: int) -> bool:
    """MySQL/MariaDB: the connection ``owner`` still holds every named lock ``names``."""
    if not names:
        return False
    checks = " AND ".join(f"IS_USED_LOCK(:n{i}) <=> :owner" for i in range(len(names)))
    params: dict[str, Any] = {f"n{i}": name for i, name in enumerate(names)}
    params["owner"] = owner
    return bool(connection.execute(text(f"SELECT {checks}"), params).scalar())


def table_size(connection: Connection, table_name: str) -> int | None:
    """The table's size on disk in bytes, indexes included (PostgreSQL; else ``None``)."""
    if traits(connection).family != "postgresql":
        return None
    size = connection.execute(
        text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": table_name}
    ).scalar()
    return None if size is None else int(size)


def connect_defaults(backend: str, options: dict[str, Any]) -> None:
    """Fill in ``create_engine`` options of one database (the caller's own ones win).

    SQLite: a 30 s busy timeout, connections usable from other threads. PostgreSQL: a
    5 s connect timeout and ``application_name=mqdedup`` (visible in
    ``pg_stat_activity``).
    """
    if backend == "sqlite":
        options.setdefault("connect_args", {"timeout": 30, "check_same_thread": False})
    elif backend == "postgresql":
        connect_args = options.setdefault("connect_args", {})
        connect_args.setdefault("connect_timeout", 5)
        connect_args.setdefault("application_name", "mqdedup")


def configure_engine(engine: Engine) -> None:
    """Per-connection setup of one database; SQLite: WAL and ``BEGIN IMMEDIATE``.

    SQLAlchemy, not the sqlite3 module, decides where transactions begin, and they begin
    with ``BEGIN IMMEDIATE`` so that savepoints and concurrent writers work.
    """
    if traits(engine).family != "sqlite":
        return

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
