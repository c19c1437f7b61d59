"""Sessions of SQL units of work: one leased per batch, and SQLite's self-deadlock."""

from __future__ import annotations

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.db.dialects import is_sqlite_lock_error


class SQLiteSelfDeadlockError(RuntimeError):
    """A handler waited for the SQLite write lock its own consumer transaction holds.

    SQLite allows one writer per database file. The processor's transaction takes the
    lock with the claim (mqdedup's engines with ``BEGIN IMMEDIATE``), so a handler that
    writes to the same file through another connection waits until its busy timeout and
    could never succeed. It fails that message instead of retrying the batch forever.
    """


class SessionLease:
    """One connection and one session for a batch's transactions (one per message).

    Checking a connection out of the pool and building a session for every message
    costs ~100 µs of CPU, a sizeable part of a one-message transaction. The session is
    bound to a connection held for the batch; each message still begins and commits
    its own transaction on it. Any error closes both (the next use starts afresh).
    """

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self._session: Session | None = None
        self._connection: Connection | None = None

    def unit(self) -> Session:
        """The unit of work careful mode counts attempts in: the leased session (opened
        on first use)."""
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


def waits_for_own_lock(session: Session, error: Exception) -> bool:
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


def self_deadlock(error: Exception) -> SQLiteSelfDeadlockError:
    """The error a handler gets instead of waiting for its own transaction's lock."""
    deadlock = SQLiteSelfDeadlockError(
        "the handler waited for the SQLite write lock that its own consumer transaction "
        "holds (SQLite allows one writer per file): write through ctx.session, not "
        "through another connection or engine to the same database file"
    )
    deadlock.__cause__ = error
    return deadlock
