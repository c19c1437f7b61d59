"""Shard coordination behind one protocol: the shared fair-share rebalancing, and the
choice of the implementation by the database (no server needed)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.dialects.sqlite.base import SQLiteDialect

from mqdedup.db.dialects import traits
from mqdedup.errors import ConfigurationError
from mqdedup.outbox.coordination import (
    FairShareCoordinator,
    MySQLCoordinator,
    PostgreSQLCoordinator,
    ShardCoordinator,
    create_coordinator,
)
from mqdedup.outbox.store import ShardFilter


class LockTable:
    """A server's lock table: shard -> holder, and the members."""

    def __init__(self) -> None:
        self.shards: dict[int, int] = {}
        self.members: set[int] = set()


class FakeCoordinator(FairShareCoordinator):
    """The lock primitives over a shared in-memory lock table."""

    def __init__(self, locks: LockTable, pid: int, shards: int) -> None:
        super().__init__(table_name="outbox", shards=shards)
        self.locks = locks
        self.pid = pid
        self.is_open = False

    @property
    def backend_pid(self) -> int:
        return self.pid

    @property
    def connected(self) -> bool:
        return self.is_open

    def open(self) -> None:
        self.locks.members.add(self.pid)
        self.is_open = True

    def close(self) -> None:  # the server drops every lock of the connection
        self.locks.members.discard(self.pid)
        for shard in [s for s, holder in self.locks.shards.items() if holder == self.pid]:
            del self.locks.shards[shard]
        self.owned.clear()
        self.is_open = False

    def shard_filter(self, shards: set[int] | None = None) -> ShardFilter:
        chosen = frozenset(self.owned if shards is None else shards & self.owned)
        return ShardFilter(self.shards, chosen, 0, self.pid)

    def wait(self, timeout: float) -> bool:
        return False

    def _holders(self) -> dict[int, set[int]]:
        holders: dict[int, set[int]] = {}
        for shard, holder in self.locks.shards.items():
            holders.setdefault(holder, set()).add(shard)
        return holders

    def _members(self) -> int:
        return len(self.locks.members)

    def _take(self, shard: int) -> bool:
        return self.locks.shards.setdefault(shard, self.pid) == self.pid

    def _release(self, shard: int) -> None:
        del self.locks.shards[shard]


def _settle(relays: list[FakeCoordinator], rounds: int = 3) -> None:
    for _ in range(rounds):
        for relay in relays:
            relay.rebalance()


def test_relays_share_the_shards_fairly_and_take_over_those_of_a_relay_that_left() -> None:
    locks = LockTable()
    relays = [FakeCoordinator(locks, pid, shards=10) for pid in (101, 202, 303)]
    first: ShardCoordinator = relays[0]  # the relay sees only the protocol
    first.open()
    assert first.rebalance() == set(range(10)), "alone, a relay takes every shard"

    for relay in relays[1:]:
        relay.open()
    _settle(relays)
    owned = [relay.owned for relay in relays]
    assert max(len(shards) for shards in owned) == 4  # ceil(10 / 3), never more
    assert set().union(*owned) == set(range(10)), "every shard has an owner"
    assert sum(len(shards) for shards in owned) == 10, "no shard has two owners"

    relays[1].close()  # dies: its locks go with its connection
    _settle([relays[0], relays[2]])
    assert relays[0].owned | relays[2].owned == set(range(10))
    assert len(relays[0].owned) == len(relays[2].owned) == 5
    assert relays[0].shard_filter({0, 1, 2, 3, 4, 5}).owned <= frozenset(relays[0].owned)


def test_the_database_chooses_the_coordinator() -> None:
    chosen = {}
    for url in (
        "postgresql+psycopg://u:p@127.0.0.1:1/db",
        "mysql+pymysql://u:p@127.0.0.1:1/db",
        "mariadb+pymysql://u:p@127.0.0.1:1/db",
        "sqlite://",
    ):
        engine = create_engine(url)  # never connects
        coordinator = create_coordinator(
            engine, table_name="t_outbox", channel="t_outbox", shards=8, fingerprint="kafka"
        )
        chosen[engine.dialect.name] = type(coordinator)
        engine.dispose()
    assert chosen == {
        "postgresql": PostgreSQLCoordinator,
        "mysql": MySQLCoordinator,
        "mariadb": MySQLCoordinator,
        "sqlite": type(None),
    }


def test_only_postgresql_wakes_the_relay_and_shard_counts_are_checked() -> None:
    engine = create_engine("postgresql+psycopg://u:p@127.0.0.1:1/db")
    try:
        for listen in (True, False):
            coordinator = create_coordinator(
                engine, table_name="t", channel="t", shards=4, fingerprint="k", listen=listen
            )
            assert coordinator is not None and coordinator.notifies is listen
        with pytest.raises(ConfigurationError, match="between 1 and 4096"):
            create_coordinator(engine, table_name="t", channel="t", shards=0, fingerprint="k")
    finally:
        engine.dispose()
    assert traits(create_engine("mysql+pymysql://u:p@127.0.0.1:1/db")).notifies is False


def test_an_unsupported_database_gets_a_clear_answer() -> None:
    dialect = SQLiteDialect()
    dialect.name = "mssql"
    with pytest.raises(ConfigurationError, match="supports PostgreSQL, MySQL/MariaDB and SQLite"):
        traits(dialect)
