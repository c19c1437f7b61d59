"""Everything that differs between databases lives here.

* which errors are *transient* (retry the transaction, never dead-letter), decided by
  SQLSTATE / driver error code / exception class, never by the text of a message;
* the claim statement (``INSERT … ON CONFLICT DO NOTHING RETURNING``);
* the attempt-counter upsert.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Table, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

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
# MySQL/MariaDB: lock wait timeout, deadlock, server gone / lost / cannot connect.
_MYSQL_TRANSIENT_CODES = frozenset({1205, 1213, 2002, 2003, 2006, 2013, 1040, 1053})


def is_transient(error: BaseException) -> bool:
    """True when ``error`` is an infrastructure failure worth retrying the transaction for."""
    if isinstance(error, sa_exc.DBAPIError):
        if error.connection_invalidated:
            return True
        return _is_transient_driver_error(error.orig)
    if isinstance(error, sa_exc.TimeoutError | sa_exc.DisconnectionError):
        return True  # pool checkout timed out / disconnect detected by the pool
    return _is_transient_driver_error(error)


def _is_transient_driver_error(orig: BaseException | None) -> bool:
    if orig is None:
        return False
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate in _TRANSIENT_SQLSTATES or sqlstate.startswith(_TRANSIENT_SQLSTATE_CLASSES)
    module = type(orig).__module__
    if module.startswith("psycopg"):
        # No SQLSTATE: the error never reached the server (refused, reset, timed out).
        import psycopg

        return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", None) in _SQLITE_TRANSIENT_CODES
    if module.startswith("pymysql"):
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        return len(args) > 0 and args[0] in _MYSQL_TRANSIENT_CODES
    return False


def claim_ids(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """Insert ``ids`` (already sorted) for ``consumer``; return those that were new.

    One statement per batch. A concurrent transaction holding the same key makes this
    statement wait on the unique index until that transaction ends.
    """
    if not ids:
        return set()
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        statement = text(
            f"INSERT INTO {table.name} (consumer_name, message_id, processed_at) "
            "SELECT :consumer, i, :now FROM unnest(CAST(:ids AS text[])) AS i ORDER BY i "
            "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
        )
        rows = session.execute(statement, {"consumer": consumer, "ids": list(ids), "now": now})
        return {row[0] for row in rows}
    if dialect == "sqlite":
        insert_stmt = sqlite.insert(table).values(
            [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in ids]
        )
        rows = session.execute(insert_stmt.on_conflict_do_nothing().returning(table.c.message_id))
        return {row[0] for row in rows}
    raise NotImplementedError(f"claiming is not implemented for the {dialect!r} database")


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
    raise NotImplementedError(f"attempt counting is not implemented for the {dialect!r} database")
