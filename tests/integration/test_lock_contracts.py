"""Locks hold their contracts on real databases and Redis (issue #39).

* ``fenced_update`` over several rows is all or nothing: when one matching row was
  written by a later lock holder, no row is updated and ``StaleTokenError`` is raised
  (PostgreSQL, MariaDB, SQLite), also when the caller catches the error and commits.
* Redis locks of any two names are independent: ``X`` and ``X:fence`` (whose key was
  ``X``'s fence counter), names with ``{``, ``}``, ``%`` and ``:`` in them. A fence
  counter of the old key layout is carried over, so tokens keep growing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, insert, select

from mqdedup.locks import RedisLock, StaleTokenError, fenced_update
from tests.services import TestDatabase, prefixed_database, table_prefix

pytestmark = pytest.mark.integration


def stock_table(prefix: str) -> Table:
    return Table(
        f"{prefix}fenced_stock",
        MetaData(),
        Column("sku", String(64), primary_key=True),
        Column("shelf", String(16), nullable=False),
        Column("count", Integer, nullable=False),
        Column("fence_token", BigInteger, nullable=True),
    )


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    if request.param == "postgresql":
        url, service = request.getfixturevalue("pg_url"), "PostgreSQL"
    elif request.param == "mariadb":
        url, service = request.getfixturevalue("mariadb_url"), "MariaDB"
    else:
        url, service = f"sqlite:///{tmp_path / 'fenced.db'}", "SQLite"
    prefix = table_prefix()
    stock = stock_table(prefix)
    with prefixed_database(url, service, stock.metadata, prefix=prefix) as database:
        with database.engine.begin() as connection:
            connection.execute(
                insert(stock),
                [
                    {"sku": "a", "shelf": "s1", "count": 1, "fence_token": 5},
                    {"sku": "b", "shelf": "s1", "count": 1, "fence_token": 9},  # a later holder
                    {"sku": "c", "shelf": "s1", "count": 1, "fence_token": None},
                    {"sku": "d", "shelf": "s2", "count": 1, "fence_token": 3},
                ],
            )
        yield database


def rows(db: TestDatabase) -> dict[str, tuple[int, int | None]]:
    stock = stock_table(db.prefix)
    with db.engine.connect() as connection:
        found = connection.execute(select(stock.c.sku, stock.c.count, stock.c.fence_token)).all()
    return {row.sku: (row.count, row.fence_token) for row in found}


BEFORE = {"a": (1, 5), "b": (1, 9), "c": (1, None), "d": (1, 3)}


def test_a_fenced_update_over_several_rows_with_one_stale_updates_none(db: TestDatabase) -> None:
    stock = stock_table(db.prefix)
    refused = pytest.raises(StaleTokenError, match="token 7 is stale, token 9")
    with refused, db.engine.begin() as connection:
        fenced_update(connection, stock, stock.c.shelf == "s1", {"count": 2}, 7)
    assert rows(db) == BEFORE

    # A caller that catches the refusal and commits still has nothing written.
    with db.engine.begin() as connection, pytest.raises(StaleTokenError):
        fenced_update(connection, stock, stock.c.shelf == "s1", {"count": 3}, 7)
    assert rows(db) == BEFORE

    # A token at least every row's: all of them, and only them, are written.
    with db.engine.begin() as connection:
        assert fenced_update(connection, stock, stock.c.shelf == "s1", {"count": 4}, 9) == 3
    assert rows(db) == {"a": (4, 9), "b": (4, 9), "c": (4, 9), "d": (1, 3)}
    with db.engine.begin() as connection:
        assert fenced_update(connection, stock, stock.c.sku == "none", {"count": 5}, 1) == 0


# -- Redis keys ------------------------------------------------------------------------------

TRICKY_NAMES = [
    "X",
    "X:fence",
    "X:fence:fence",
    "{X}",
    "{X}:fence",
    "X}",
    "{X",
    "%7BX%7D",
    "%7BX",
    "fence:X",
    "lock:X",
    "X:lock:{X}",
]


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_redis_locks_of_any_two_names_are_independent(redis_client: redis.Redis) -> None:
    namespace = f"test-lock-keys-{uuid.uuid4().hex[:8]}"
    try:
        locks = {
            name: RedisLock(name, redis_client, ttl=30, namespace=namespace)
            for name in TRICKY_NAMES
        }
        leases = {name: lock.try_acquire() for name, lock in locks.items()}
        assert all(lease is not None for lease in leases.values()), leases  # none blocked
        assert {name: lease.token for name, lease in leases.items() if lease} == dict.fromkeys(
            TRICKY_NAMES, 1
        )  # no acquisition moved another lock's counter
        for name, lock in locks.items():
            lease = leases[name]
            assert lease is not None
            lock.release(lease)  # each lock's value is still its own
        again = locks["X"].acquire(timeout=1)
        assert again.token == 2
        locks["X"].release(again)
        keys = [key for lock in locks.values() for key in (lock.key, lock.fence_key)]
        assert len(set(keys)) == len(keys)  # no name shares a key with another
    finally:
        redis_client.delete(*(redis_client.keys(f"{namespace}:*") or [f"{namespace}:none"]))


def test_a_fence_counter_of_the_old_key_layout_is_carried_over(redis_client: redis.Redis) -> None:
    namespace = f"test-lock-keys-{uuid.uuid4().hex[:8]}"
    try:
        redis_client.set(f"{namespace}:lock:stock:fence", 41)  # the old layout's counter
        # An old-layout lock "other:fence" held: its value is not a counter, not carried.
        redis_client.set(f"{namespace}:lock:other:fence", "owner:3")
        lock = RedisLock("stock", redis_client, namespace=namespace)
        lease = lock.acquire(timeout=1)
        assert lease.token == 42
        lock.release(lease)
        assert RedisLock("stock", redis_client, namespace=namespace).acquire(1).token == 43
        assert RedisLock("other", redis_client, namespace=namespace).acquire(1).token == 1
    finally:
        redis_client.delete(*(redis_client.keys(f"{namespace}:*") or [f"{namespace}:none"]))
