"""SQLite: a handler's own connection to the consumer's database file fails fast.

SQLite allows one writer per file. While handlers run, the processor's transaction
holds that file's write lock (mqdedup's engines take it with ``BEGIN IMMEDIATE``; the
claim takes it on any engine). A handler that writes to the same file through another
connection waits for a lock that is only released after the handler returns: with the
usual busy timeout (30 s in mqdedup's engines) it would hang that long, every attempt.

While a handler runs, any other SQLite connection to the same file checked out of a
SQLAlchemy pool in the handler's thread gets a short busy timeout
(:data:`HANDLER_BUSY_TIMEOUT_MS`), restored when it goes back to the pool. Reads that
need no lock (WAL mode) are unaffected; a write fails within a second with SQLITE_BUSY,
which the processor reports as
:class:`~mqdedup.consumers.processor.SQLiteSelfDeadlockError` for that message.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool

#: Busy timeout of another connection to the consumer's SQLite file during a handler.
HANDLER_BUSY_TIMEOUT_MS = 1000
_RESTORE_KEY = "mqdedup.sqlite_busy_timeout"


class _Holder(threading.local):
    session: Session | None = None


_holder = _Holder()
_installed = threading.Lock()
_listening = False


def enter(session: Session) -> None:
    """The handlers of this thread run inside ``session``'s transaction from now on."""
    _holder.session = session


def leave() -> None:
    """The handlers of this thread are done; the transaction is about to end."""
    _holder.session = None


def install() -> None:
    """Listen to pool checkouts / checkins (once per process; SQLite processors only)."""
    global _listening  # noqa: PLW0603 - one process-wide listener
    with _installed:
        if not _listening:
            event.listen(Pool, "checkout", _on_checkout)
            event.listen(Pool, "checkin", _on_checkin)
            _listening = True


def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
    session = _holder.session
    if session is None or not isinstance(dbapi_connection, sqlite3.Connection):
        return
    own = _own_dbapi_connection(session)
    if own is None or own is dbapi_connection:
        return
    database = _database_file(own)
    if not database or database != _database_file(dbapi_connection):
        return  # another file, or in-memory databases (each its own)
    original = dbapi_connection.execute("PRAGMA busy_timeout").fetchone()[0]
    dbapi_connection.execute(f"PRAGMA busy_timeout={HANDLER_BUSY_TIMEOUT_MS}")
    record.info[_RESTORE_KEY] = int(original)


def _on_checkin(dbapi_connection: Any, record: Any) -> None:
    original = record.info.pop(_RESTORE_KEY, None) if record is not None else None
    if original is not None and dbapi_connection is not None:
        dbapi_connection.execute(f"PRAGMA busy_timeout={int(original)}")


def _own_dbapi_connection(session: Session) -> sqlite3.Connection | None:
    """The processor's own SQLite DBAPI connection (None when not on SQLite)."""
    try:
        connection = session.connection()
    except Exception:  # the session is not in a usable state: nothing to protect
        return None
    dbapi = connection.connection.dbapi_connection
    return dbapi if isinstance(dbapi, sqlite3.Connection) else None


def _database_file(connection: sqlite3.Connection) -> str:
    """The file of the ``main`` database ("" for an in-memory one)."""
    for _seq, name, path in connection.execute("PRAGMA database_list").fetchall():
        if name == "main":
            return str(path or "")
    return ""
