"""Shard coordination on MySQL / MariaDB: named locks on the relay's connection, polled.

The MySQL/MariaDB :class:`~mqdedup.outbox.coordination.ShardCoordinator`. Each shard is
owned through a *named lock* (``GET_LOCK(name, 0)``, session-scoped) held on the relay's
dedicated connection; members hold named locks too, so relays can count each other and
share the shards fairly (:class:`~mqdedup.outbox.coordination.FairShareCoordinator`).
When a relay dies, the server drops its connection and with it every lock.

Lock names are server-wide, so they carry a hash of the database and table name
(``mqd:<crc32>:…``, well below the 64-character limit). Members hold two locks: one in
the namespace of their settings (shards and brokers) and one generic; a generic holder
without a lock in our settings' namespace runs with other settings, which is refused
like on PostgreSQL.

There is no ``LISTEN`` on MySQL/MariaDB: the relay polls every ``poll_interval``.

The claim (:meth:`mqdedup.outbox.store.OutboxStore.claim`) checks with ``IS_USED_LOCK``
(:func:`mqdedup.db.dialects.named_locks_held`) that this connection still holds the
shards it claims from, inside the claim's transaction, so a relay whose control
connection was lost claims nothing.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, text

from mqdedup.errors import ConfigurationError
from mqdedup.outbox.coordination import FairShareCoordinator
from mqdedup.outbox.store import ShardFilter

log = logging.getLogger(__name__)

MAX_MEMBERS = 128
_BATCH = 512  # IS_USED_LOCK calls per SELECT


def lock_namespace(database: str, table_name: str) -> str:
    """The prefix of every named lock of one outbox table (server-wide unique)."""
    return f"mqd:{zlib.crc32(f'{database}.{table_name}'.encode()):08x}"


def shard_lock_name(namespace: str, shard: int) -> str:
    """The named lock that makes a relay the owner of ``shard``."""
    return f"{namespace}:s:{shard}"


class MySQLCoordinator(FairShareCoordinator):
    """One relay's dedicated autocommit connection holding its named locks (MySQL/MariaDB).

    ``notifies`` is False: there is no ``LISTEN`` on MySQL/MariaDB, the relay polls.
    """

    def __init__(self, engine: Engine, *, table_name: str, shards: int, fingerprint: str) -> None:
        super().__init__(table_name=table_name, shards=shards)
        self.engine = engine
        self.config_key = f"{zlib.crc32(f'{shards}:{fingerprint}'.encode()):08x}"
        self.namespace = ""
        self._connection: Connection | None = None
        self._connection_id = 0

    # -- connection ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while the connection is open (it may still turn out broken)."""
        connection = self._connection
        return connection is not None and not connection.closed and not connection.invalidated

    def open(self) -> None:
        """Connect, join as a member and check that relays agree on settings."""
        self.close()
        connection = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        connection.detach()  # ours alone: never returned to the pool, closed for real
        self._connection = connection
        try:
            database, connection_id = connection.execute(
                text("SELECT DATABASE(), CONNECTION_ID()")
            ).one()
            self.namespace = lock_namespace(str(database), self.table_name)
            self._connection_id = int(connection_id)
            self._join()
            self._check_config()
        except BaseException:
            self.close()
            raise
        log.info(
            "relay control connection open",
            extra={"table": self.table_name, "connection_id": self._connection_id},
        )

    def close(self) -> None:
        """Close the connection; the server releases every named lock it held."""
        connection, self._connection = self._connection, None
        self.owned.clear()
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken: nothing left to release
                connection.close()

    @property
    def backend_pid(self) -> int:
        """The server's id of this connection (what ``IS_USED_LOCK`` reports)."""
        return self._connection_id

    def shard_filter(self, shards: set[int] | None = None) -> ShardFilter:
        """The claim filter for ``shards`` (default: all this connection holds)."""
        chosen = frozenset(self.owned if shards is None else shards & self.owned)
        names = tuple(shard_lock_name(self.namespace, shard) for shard in sorted(chosen))
        return ShardFilter(self.shards, chosen, 0, self._connection_id, names)

    # -- wake-up -----------------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """No notifications on MySQL/MariaDB: always False (the relay polls)."""
        return False

    # -- shards ------------------------------------------------------------------------------

    def _take(self, shard: int) -> bool:
        return self._try_lock(self._shard(shard))

    def _release(self, shard: int) -> None:
        self._execute("SELECT RELEASE_LOCK(:name)", name=self._shard(shard))

    # -- locks -------------------------------------------------------------------------------

    def _shard(self, shard: int) -> str:
        return shard_lock_name(self.namespace, shard)

    def _member(self, slot: int) -> str:
        return f"{self.namespace}:c:{self.config_key}:{slot}"

    def _generic_member(self, slot: int) -> str:
        return f"{self.namespace}:g:{slot}"

    def _holders(self) -> dict[int, set[int]]:
        names = [self._shard(shard) for shard in range(self.shards)]
        holders: dict[int, set[int]] = {}
        for shard, holder in enumerate(self._used_by(names)):
            if holder is not None:
                holders.setdefault(holder, set()).add(shard)
        return holders

    def _members(self) -> int:
        names = [self._member(slot) for slot in range(MAX_MEMBERS)]
        return sum(1 for holder in self._used_by(names) if holder is not None)

    def _join(self) -> None:
        # The settings' lock first, then the generic one: whoever holds a generic lock
        # already holds the lock of its settings (see _check_config).
        for name_of in (self._member, self._generic_member):
            for slot in range(MAX_MEMBERS):
                if self._try_lock(name_of(slot)):
                    break
            else:
                raise ConfigurationError(f"more than {MAX_MEMBERS} relays on {self.table_name}")

    def _check_config(self) -> None:
        for attempt in range(2):
            # Generic members first: a member seen there holds its settings' lock already.
            generic = self._used_by([self._generic_member(slot) for slot in range(MAX_MEMBERS)])
            same = self._used_by([self._member(slot) for slot in range(MAX_MEMBERS)])
            others = {h for h in generic if h is not None} - {h for h in same if h is not None}
            if not others:
                return
            if attempt == 0:
                continue  # a member may have left between the two reads; look again
        raise ConfigurationError(
            f"another relay on {self.table_name} runs with different shards or publishers; "
            "all relays of one outbox table need the same shards and brokers"
        )

    def _used_by(self, names: Sequence[str]) -> list[int | None]:
        """The connection id holding each named lock (``None``: free), in few round trips."""
        result: list[int | None] = []
        for start in range(0, len(names), _BATCH):
            chunk = names[start : start + _BATCH]
            columns = ", ".join(f"IS_USED_LOCK(:n{i})" for i in range(len(chunk)))
            row = self._execute(
                f"SELECT {columns}", **{f"n{i}": name for i, name in enumerate(chunk)}
            ).one()
            result.extend(None if value is None else int(value) for value in row)
        return result

    def _try_lock(self, name: str) -> bool:
        return bool(self._execute("SELECT GET_LOCK(:name, 0)", name=name).scalar())

    def _execute(self, statement: str, **params: Any) -> Any:
        connection = self._connection
        if connection is None:
            raise ConfigurationError("the relay control connection is not open")
        return connection.execute(text(statement), params)

