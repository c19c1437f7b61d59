"""Shard coordination: how several relays share one outbox table, and when a relay may claim
from a shard. Rows are spread over shards by the hash of their key and each shard is
owned by one relay at a time through a lock held on that relay's dedicated *control
connection*, so a key's rows are published by one relay, in id order; the relay sees
this only through the :class:`ShardCoordinator` protocol, implemented with advisory locks
and ``LISTEN`` on PostgreSQL (:class:`PostgreSQLCoordinator`) and named locks, polled, on
MySQL/MariaDB (:class:`MySQLCoordinator`), chosen by :func:`create_coordinator` (SQLite has
none: one relay, which polls); a shard just taken over from a relay that died waits for
that relay's lease (:class:`LeaseTakeover`)."""

from __future__ import annotations

import contextlib
import logging
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, text
from sqlalchemy.dialects import postgresql

from mqdedup.db.dialects import traits
from mqdedup.db.pooling import declares_transaction_pooler, keeps_session
from mqdedup.errors import ConfigurationError
from mqdedup.logs import RepeatedLog
from mqdedup.masking import mask_url
from mqdedup.outbox.store import MAX_LEASE_SHARDS, OutboxStore, ShardFilter

log = logging.getLogger(__name__)
#: A relay taking over shards waits for the leases of the relay that had them.
LEASE_WAIT = "waiting for another relay's leases to expire before claiming"
_WAITS = RepeatedLog(log)

MAX_SHARDS = MAX_LEASE_SHARDS
#: The second key of the ``turns`` lock class that session relays hold shared for their
#: whole life (see :class:`PostgreSQLCoordinator`); ``0`` is the turn itself.
SESSION_PRESENCE_KEY = 1


class ShardCoordinator(Protocol):
    """What the relay needs to share an outbox table with other relays.

    When a relay dies the database drops its control connection and with it every lock;
    the others take its shards (its leased rows come back when their lease expires, and a
    shard just taken over waits for them, see :class:`LeaseTakeover`).

    * ``open()`` connects, joins as a member and refuses to run beside relays with other
      settings; ``close()`` releases everything (the connection goes);
    * ``rebalance()`` acquires or releases shards until this relay holds its fair share
      (``ceil(shards / members)``), see :class:`FairShareCoordinator`;
    * ``shard_filter()`` restricts a claim to the owned shards and makes the claim check,
      in its own transaction, that the locks are *still held*: a relay whose control
      connection was lost claims nothing;
    * ``wait(timeout)`` sleeps until a commit notification (``notifies``) or the timeout.
    """

    #: The number of shards rows are spread over (the same for every relay of a table).
    shards: int
    #: The shards this relay holds now.
    owned: set[int]
    #: ``wait`` returns early when outbox rows commit (PostgreSQL ``LISTEN``).
    notifies: bool

    @property
    def connected(self) -> bool:
        """True while the control connection is open (it may still turn out broken)."""
        ...

    def open(self) -> None:
        """Connect, join as a member; ConfigurationError if other relays differ."""
        ...

    def rebalance(self) -> set[int]:
        """Acquire or release shards to this relay's fair share; return the owned ones."""
        ...

    def shard_filter(self, shards: set[int] | None = None) -> ShardFilter:
        """The claim filter for ``shards`` (default: all owned), with the still-held check."""
        ...

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a commit notification; True if one came."""
        ...

    def close(self) -> None:
        """Close the control connection: every lock it held is released."""
        ...


class FairShareCoordinator(ABC):
    """The rebalancing both implementations share; they provide the lock primitives.

    Each relay keeps ``ceil(shards / members)`` shards: it releases extra ones between
    batches and takes free ones, starting at a position that depends on its connection
    id so that relays try different shards first.
    """

    notifies = False

    def __init__(self, *, table_name: str, shards: int) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ConfigurationError(
                f"relay shards must be between 1 and {MAX_SHARDS}, got {shards}"
            )
        self.table_name = table_name
        self.shards = shards
        self.owned: set[int] = set()

    # -- what an implementation provides ---------------------------------------------------

    @property
    @abstractmethod
    def backend_pid(self) -> int:
        """The server's id of the control connection (the lock owner it reports)."""

    @abstractmethod
    def _holders(self) -> dict[int, set[int]]:
        """Connection id → the shards it holds, for every held shard lock."""

    @abstractmethod
    def _members(self) -> int:
        """How many relays of this table are members now."""

    @abstractmethod
    def _take(self, shard: int) -> bool:
        """Try to lock ``shard`` without waiting; True if this connection holds it now."""

    @abstractmethod
    def _release(self, shard: int) -> None:
        """Unlock ``shard``."""

    # -- shared ------------------------------------------------------------------------------

    def rebalance(self) -> set[int]:
        """Keep this relay's fair share of shards; return the shards it owns now."""
        holders = self._holders()
        members = max(1, self._members())
        fair = math.ceil(self.shards / members)
        mine = holders.get(self.backend_pid, set())
        if mine != self.owned:  # cannot happen while connected; resync to the server's view
            log.warning("shard locks differ from what the relay believed; resyncing")
            self.owned = set(mine)
        if len(self.owned) > fair:
            for shard in sorted(self.owned, reverse=True)[: len(self.owned) - fair]:
                self._release(shard)
                self.owned.discard(shard)
            log.info("released shards", extra={"owned": len(self.owned), "members": members})
        elif len(self.owned) < fair:
            taken = set().union(*holders.values()) if holders else set()
            free = [shard for shard in range(self.shards) if shard not in taken]
            start = len(self.owned)
            for shard in _rotate(free, self.backend_pid):
                if len(self.owned) >= fair:
                    break
                if self._take(shard):
                    self.owned.add(shard)
            if len(self.owned) != start:
                log.info("took shards", extra={"owned": len(self.owned), "members": members})
        return set(self.owned)


def _rotate(items: list[int], seed: int) -> Iterable[int]:
    """``items`` starting at a seed-dependent position (relays try different shards first)."""
    if not items:
        return []
    start = seed % len(items)
    return items[start:] + items[:start]


# -- PostgreSQL: advisory locks and LISTEN ----------------------------------------------------

_PREPARER: Any = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]


def _quote_identifier(name: str) -> str:
    """``name`` as a PostgreSQL identifier (no psycopg import: SQLite users load this too)."""
    return str(_PREPARER.quote_identifier(name))


POSTGRESQL_MAX_MEMBERS = 1024
_CURRENT_DATABASE = (
    "database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND locktype = 'advisory' AND objsubid = 2 AND granted"
)


def lock_class(table_name: str, purpose: str) -> int:
    """The advisory-lock class (first int4 key) of ``purpose`` for one outbox table."""
    return zlib.crc32(f"mqdedup:{table_name}:{purpose}".encode()) & 0x7FFFFFFF


class PostgreSQLCoordinator(FairShareCoordinator):
    """One relay's dedicated autocommit psycopg connection holding its advisory locks.

    Each shard is owned through a session-level advisory lock held on this connection;
    each relay holds a *member* advisory lock, so relays can count each other and share
    the shards fairly. When a relay dies, PostgreSQL drops its locks and the others take
    over its shards. The claim statement checks ``pg_locks`` for this connection's backend
    pid (read with ``pg_backend_pid()``, never the pid a pooler announced at login), so if
    this connection is lost the relay claims nothing until it has reconnected and
    re-acquired shards.

    Relays with ``coordination = transaction`` (no session: :meth:`OutboxStore.claim_in_turn
    <mqdedup.outbox.store.OutboxStore.claim_in_turn>`) may share the table: on joining,
    this relay takes the ``turns`` lock class's *presence* key in shared mode and keeps
    it. A transaction-mode claim try-locks that key exclusively and claims nothing while
    any session relay holds it; a session relay joining waits for a turn-taking claim in
    progress to commit, so its first look at the leases sees that claim's lease (which
    covers every shard) and waits for it to end. Relays in any mix of modes thus publish
    each row once, a key's rows in order.
    """

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
        self.turns_class = lock_class(table_name, "turns")
        self._raw: Any = None
        self._conn: Any = None
        self._pid = 0

    # -- connection ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while the connection is open (it may still turn out broken)."""
        return self._conn is not None and not self._conn.closed

    def open(self) -> None:
        """Connect, ``LISTEN``, join as a member and check that relays agree on settings."""
        self.close()
        raw = self.engine.raw_connection()
        if not keeps_session(self.engine, raw):
            raw.close()
            raise ConfigurationError(pooled_control_message(self.engine))
        conn: Any = raw.driver_connection
        raw.detach()  # ours alone: never returned to the pool, closed for real
        conn.rollback()
        conn.autocommit = True
        self._raw, self._conn = raw, conn
        try:
            # The server's own pid: a pooler announces another one at login.
            self._pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
            if self.notifies:
                conn.execute(f"LISTEN {_quote_identifier(self.channel)}")
            self._join()
            self._check_config()
            # Waits for a turn-taking claim in progress (see the class docstring).
            conn.execute(
                "SELECT pg_advisory_lock_shared(%s::int, %s::int)",
                (self.turns_class, SESSION_PRESENCE_KEY),
            )
        except BaseException:
            self.close()
            raise
        log.info(
            "relay control connection open",
            extra={"table": self.table_name, "backend_pid": self.backend_pid},
        )

    def close(self) -> None:
        """Release every advisory lock and ``LISTEN``, then close the connection.

        Released explicitly: behind a session pooler the server connection outlives
        ours and goes to the next client (PostgreSQL releases them when the server
        connection ends; the pooler's ``server_reset_query = DISCARD ALL`` when a relay
        dies without this)."""
        raw, conn, self._raw, self._conn = self._raw, self._conn, None, None
        self.owned.clear()
        if raw is None:
            return
        try:
            if conn is not None and not conn.closed:
                conn.execute("SELECT pg_advisory_unlock_all()")
                conn.execute("UNLISTEN *")
        except Exception:  # already broken: the server ends the session and its locks
            log.debug("releasing the control connection's locks failed", exc_info=True)
        try:
            raw.close()
        except Exception:  # already broken: nothing left to release
            log.debug("closing a broken control connection", exc_info=True)

    @property
    def backend_pid(self) -> int:
        """The server process id of this connection (``pg_backend_pid()``, read on open:
        the owner in ``pg_locks``)."""
        return self._pid

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
        for slot in range(POSTGRESQL_MAX_MEMBERS):
            if self._try_lock(self.member_class, slot):
                return
        raise ConfigurationError(f"more than {POSTGRESQL_MAX_MEMBERS} relays on {self.table_name}")

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


# -- MySQL / MariaDB: named locks, polled ------------------------------------------------------

MYSQL_MAX_MEMBERS = 128
_BATCH = 512  # IS_USED_LOCK calls per SELECT


def lock_namespace(database: str, table_name: str) -> str:
    """The prefix of every named lock of one outbox table (server-wide unique)."""
    return f"mqd:{zlib.crc32(f'{database}.{table_name}'.encode()):08x}"


def shard_lock_name(namespace: str, shard: int) -> str:
    """The named lock that makes a relay the owner of ``shard``."""
    return f"{namespace}:s:{shard}"


class MySQLCoordinator(FairShareCoordinator):
    """One relay's dedicated autocommit connection holding its named locks (MySQL/MariaDB).

    Each shard is owned through a *named lock* (``GET_LOCK(name, 0)``, session-scoped)
    held on this connection; members hold named locks too, so relays can count each other
    and share the shards fairly. When a relay dies, the server drops its connection and
    with it every lock. Lock names are server-wide, so they carry a hash of the database
    and table name (``mqd:<crc32>:…``, well below the 64-character limit). Members hold
    two locks: one in the namespace of their settings (shards and brokers) and one
    generic; a generic holder without a lock in our settings' namespace runs with other
    settings, which is refused like on PostgreSQL.

    ``notifies`` is False: there is no ``LISTEN`` on MySQL/MariaDB, the relay polls every
    ``poll_interval``. The claim (:meth:`mqdedup.outbox.store.OutboxStore.claim`) checks
    with ``IS_USED_LOCK`` (:func:`mqdedup.db.dialects.named_locks_held`) that this
    connection still holds the shards it claims from, inside the claim's transaction, so
    a relay whose control connection was lost claims nothing.
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
        names = [self._member(slot) for slot in range(MYSQL_MAX_MEMBERS)]
        return sum(1 for holder in self._used_by(names) if holder is not None)

    def _join(self) -> None:
        # The settings' lock first, then the generic one: whoever holds a generic lock
        # already holds the lock of its settings (see _check_config).
        for name_of in (self._member, self._generic_member):
            for slot in range(MYSQL_MAX_MEMBERS):
                if self._try_lock(name_of(slot)):
                    break
            else:
                raise ConfigurationError(
                    f"more than {MYSQL_MAX_MEMBERS} relays on {self.table_name}"
                )

    def _check_config(self) -> None:
        for attempt in range(2):
            # Generic members first: a member seen there holds its settings' lock already.
            generic = self._used_by(
                [self._generic_member(slot) for slot in range(MYSQL_MAX_MEMBERS)]
            )
            same = self._used_by([self._member(slot) for slot in range(MYSQL_MAX_MEMBERS)])
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


# -- choosing one, and taking over ------------------------------------------------------------


def create_coordinator(
    engine: Engine,
    *,
    table_name: str,
    channel: str,
    shards: int,
    fingerprint: str,
    listen: bool = True,
) -> ShardCoordinator | None:
    """The shard coordinator of ``engine``'s database; ``None`` where relays cannot share.

    Chosen by the ``shard_locks`` trait (:func:`mqdedup.db.dialects.traits`): advisory
    locks (PostgreSQL), named locks (MySQL/MariaDB) or none (SQLite: one relay).
    ``fingerprint`` names the relay's settings besides ``shards`` (its brokers): relays of
    one table must agree on both. ``listen`` (PostgreSQL) wakes the relay on commits.
    """
    locks = traits(engine).shard_locks
    if locks == "advisory":
        return PostgreSQLCoordinator(
            engine,
            table_name=table_name,
            channel=channel,
            shards=shards,
            fingerprint=fingerprint,
            listen=listen,
        )
    if locks == "named":
        return MySQLCoordinator(
            engine, table_name=table_name, shards=shards, fingerprint=fingerprint
        )
    return None


def pooled_control_message(engine: Engine) -> str:
    """The one line a relay says when its control connection cannot keep a session."""
    return (
        f"relay: {mask_url(engine.url)} goes through a transaction pooler (e.g. PgBouncer "
        "pool_mode = transaction), where shard locks and LISTEN cannot hold: give "
        "--control-database a direct or session-pooled URL of the same database, or run "
        "with --coordination transaction (relays take turns, polling)"
    )


def check_coordination(
    engine: Engine, control_engine: Engine | None, coordination: str, *, table_name: str
) -> int | None:
    """Check a relay's coordination settings before it connects.

    ``session``: ``None`` (a :class:`ShardCoordinator` on ``control_engine`` or
    ``engine``); refused at once when the only URL declares a transaction pooler
    (``?pooler=transaction``; a pooler found on connecting is refused by
    :meth:`PostgreSQLCoordinator.open`). ``transaction``: PostgreSQL only; the
    advisory-lock class the claims take turns under (see
    :meth:`~mqdedup.outbox.store.OutboxStore.claim_in_turn`).
    """
    if coordination == "transaction":
        if traits(engine).family != "postgresql":
            raise ConfigurationError(
                "relay coordination 'transaction' is for PostgreSQL; other databases use 'session'"
            )
        if control_engine is not None:
            raise ConfigurationError(
                "a control database is for coordination 'session'; 'transaction' needs none"
            )
        return lock_class(table_name, "turns")
    if control_engine is None:
        if declares_transaction_pooler(engine):
            raise ConfigurationError(pooled_control_message(engine))
        return None
    if traits(control_engine).family != traits(engine).family:
        raise ConfigurationError(
            "the control database must be the same database as the relay's, reached directly"
        )
    return None


def check_control_connection(engine: Engine) -> None:
    """Connect once; ConfigurationError (one line) when ``engine``'s connections cannot
    keep a session (a transaction pooler, declared or detected)."""
    with engine.connect() as connection:
        if not keeps_session(engine, connection.connection):
            raise ConfigurationError(pooled_control_message(engine))


class LeaseTakeover:
    """Which owned shards are safe to claim from (see :meth:`claimable`)."""

    def __init__(self, engine: Engine, store: OutboxStore, relay_id: str) -> None:
        self.engine = engine
        self.store = store
        self.relay_id = relay_id
        self._verified: set[int] = set()

    def reset(self) -> None:
        """Forget the verified shards (the control connection was reopened: while it was
        away, another relay may have claimed from them)."""
        self._verified.clear()

    def claimable(self, owned: set[int]) -> set[int]:
        """The owned shards that are safe to claim from.

        A shard just taken over may hold rows a relay that died was publishing; they must
        be published before later rows of their keys, so the shard waits until that
        relay's lease has expired (or the relay settled its batches and removed it).
        """
        self._verified &= owned
        unverified = owned - self._verified
        held: set[int] = set()
        if unverified:
            held = self.store.foreign_leases(self.engine, self.relay_id) & unverified
            self._verified |= unverified - held
        if held:  # checked again at every claim: written once, then less often
            _WAITS.info(
                LEASE_WAIT,
                extra={"relay": self.relay_id, "shards": sorted(held)},
                key=self.relay_id,
            )
        else:
            _WAITS.done(LEASE_WAIT, key=self.relay_id)
        return set(self._verified)
