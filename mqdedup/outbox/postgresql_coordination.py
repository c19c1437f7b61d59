"""Shard coordination on PostgreSQL: advisory locks and ``LISTEN`` on the relay's connection.

The PostgreSQL :class:`~mqdedup.outbox.coordination.ShardCoordinator`. Each shard is
owned through a session-level advisory lock held on the relay's dedicated connection;
each relay holds a *member* advisory lock, so relays can count each other and share the
shards fairly (:class:`~mqdedup.outbox.coordination.FairShareCoordinator`). When a relay
dies, PostgreSQL drops its locks and the others take over its shards.

The claim statement checks ``pg_locks`` for this connection's backend pid, so if this
connection is lost the relay claims nothing until it has reconnected and re-acquired
shards.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.dialects import postgresql

from mqdedup.errors import ConfigurationError
from mqdedup.outbox.coordination import FairShareCoordinator
from mqdedup.outbox.store import ShardFilter

log = logging.getLogger(__name__)
_PREPARER: Any = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]


def _quote_identifier(name: str) -> str:
    """``name`` as a PostgreSQL identifier (no psycopg import: SQLite users load this too)."""
    return str(_PREPARER.quote_identifier(name))


MAX_MEMBERS = 1024
_CURRENT_DATABASE = (
    "database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND locktype = 'advisory' AND objsubid = 2 AND granted"
)


def lock_class(table_name: str, purpose: str) -> int:
    """The advisory-lock class (first int4 key) of ``purpose`` for one outbox table."""
    return zlib.crc32(f"mqdedup:{table_name}:{purpose}".encode()) & 0x7FFFFFFF


class PostgreSQLCoordinator(FairShareCoordinator):
    """One relay's dedicated autocommit psycopg connection holding its advisory locks."""

    def __init__(
        self,
        engine: Engine,
        *,
        table_name: str,
        channel: str,
        shards: int,
        fingerprint: str,
        listen: bool = True,
    ) -> None:
        super().__init__(table_name=table_name, shards=shards)
        self.engine = engine
        self.channel = channel
        self.notifies = listen
        self.shard_class = lock_class(table_name, "shards")
        self.member_class = lock_class(table_name, "members")
        self.config_class = lock_class(table_name, "config")
        self.config_key = zlib.crc32(f"{shards}:{fingerprint}".encode()) & 0x7FFFFFFF
        self._raw: Any = None
        self._conn: Any = None

    # -- connection ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while the connection is open (it may still turn out broken)."""
        return self._conn is not None and not self._conn.closed

    def open(self) -> None:
        """Connect, ``LISTEN``, join as a member and check that relays agree on settings."""
        self.close()
        raw = self.engine.raw_connection()
        conn: Any = raw.driver_connection
        raw.detach()  # ours alone: never returned to the pool, closed for real
        conn.rollback()
        conn.autocommit = True
        self._raw, self._conn = raw, conn
        try:
            if self.notifies:
                conn.execute(f"LISTEN {_quote_identifier(self.channel)}")
            self._join()
            self._check_config()
        except BaseException:
            self.close()
            raise
        log.info(
            "relay control connection open",
            extra={"table": self.table_name, "backend_pid": self.backend_pid},
        )

    def close(self) -> None:
        """Close the connection; PostgreSQL releases every lock it held."""
        raw, self._raw, self._conn = self._raw, None, None
        self.owned.clear()
        if raw is not None:
            try:
                raw.close()
            except Exception:  # already broken: nothing left to release
                log.debug("closing a broken control connection", exc_info=True)

    @property
    def backend_pid(self) -> int:
        """The server process id of this connection (the owner in ``pg_locks``)."""
        return int(self._conn.info.backend_pid)

    def shard_filter(self, shards: set[int] | None = None) -> ShardFilter:
        """The claim filter for ``shards`` (default: all this connection holds)."""
        chosen = frozenset(self.owned if shards is None else shards & self.owned)
        return ShardFilter(self.shards, chosen, self.shard_class, self.backend_pid)

    # -- wake-up -----------------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a notification; True if one came (all are drained)."""
        if not self.notifies:
            return False
        woke = any(True for _ in self._conn.notifies(timeout=max(0.0, timeout), stop_after=1))
        if woke:
            for _ in self._conn.notifies(timeout=0):
                pass
        return woke

    # -- shards ------------------------------------------------------------------------------

    def _take(self, shard: int) -> bool:
        return self._try_lock(self.shard_class, shard)

    def _release(self, shard: int) -> None:
        self._conn.execute("SELECT pg_advisory_unlock(%s::int, %s::int)", (self.shard_class, shard))

    def _holders(self) -> dict[int, set[int]]:
        rows = self._conn.execute(
            f"SELECT pid, objid::bigint FROM pg_locks WHERE {_CURRENT_DATABASE} "
            "AND classid = %s::oid",
            (self.shard_class,),
        ).fetchall()
        holders: dict[int, set[int]] = {}
        for pid, shard in rows:
            holders.setdefault(int(pid), set()).add(int(shard))
        return holders

    def _members(self) -> int:
        row = self._conn.execute(
            f"SELECT count(*) FROM pg_locks WHERE {_CURRENT_DATABASE} AND classid = %s::oid",
            (self.member_class,),
        ).fetchone()
        return int(row[0])

    def _join(self) -> None:
        for slot in range(MAX_MEMBERS):
            if self._try_lock(self.member_class, slot):
                return
        raise ConfigurationError(f"more than {MAX_MEMBERS} relays on {self.table_name}")

    def _check_config(self) -> None:
        self._conn.execute(
            "SELECT pg_try_advisory_lock_shared(%s::int, %s::int)",
            (self.config_class, self.config_key),
        )
        rows = self._conn.execute(
            f"SELECT DISTINCT objid::bigint FROM pg_locks WHERE {_CURRENT_DATABASE} "
            "AND classid = %s::oid",
            (self.config_class,),
        ).fetchall()
        others = {int(row[0]) for row in rows} - {self.config_key}
        if others:
            raise ConfigurationError(
                f"another relay on {self.table_name} runs with different shards or publishers; "
                "all relays of one outbox table need the same shards and brokers"
            )

    def _try_lock(self, lock_class_id: int, key: int) -> bool:
        row = self._conn.execute(
            "SELECT pg_try_advisory_lock(%s::int, %s::int)", (lock_class_id, key)
        ).fetchone()
        return bool(row[0])

