"""Lease locks with fencing tokens on real PostgreSQL and Redis (``mqdedup.locks``).

The same scenarios run on both stores: a holder paused past its lease has its fenced
write refused after the next holder wrote (and learns it lost the lock); a lease that
ran out with nobody else waiting says so; 50 contenders hold the lock one at a time
with strictly increasing tokens; an unreachable store is a clear error.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, insert, select, text

from mqdedup.db.engine import create_engine
from mqdedup.db.schema import schema
from mqdedup.locks import (
    LeaseLock,
    LockExpiredError,
    LockLostError,
    LockTimeoutError,
    LockUnavailableError,
    PostgresLock,
    RedisLock,
    StaleTokenError,
    fenced_update,
)
from tests.services import TestDatabase, prefixed_database, table_prefix, wait_for

pytestmark = pytest.mark.integration


def stock_table(prefix: str) -> Table:
    return Table(
        f"{prefix}stock",
        MetaData(),
        Column("sku", String(64), primary_key=True),
        Column("count", Integer, nullable=False),
        Column("holder", String(64), nullable=True),
        Column("fence_token", BigInteger, nullable=True),
    )


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    prefix = table_prefix()
    stock = stock_table(prefix)
    with prefixed_database(pg_url, "PostgreSQL", stock.metadata, prefix=prefix) as database:
        with database.engine.begin() as connection:
            connection.execute(insert(stock).values(sku="sku-1", count=0))
        yield database


Factory = Callable[..., LeaseLock]


@pytest.fixture(params=["postgresql", "redis"])
def make_lock(
    request: pytest.FixtureRequest, db: TestDatabase, redis_url: str
) -> Iterator[Factory]:
    """A lock factory on one store; ``expired(name)`` tells the store's view of a lease."""
    if request.param == "postgresql":

        def factory(name: str, ttl: float) -> LeaseLock:
            return PostgresLock(db.engine, name, ttl=ttl, prefix=db.prefix, poll_interval=0.01)

        yield factory
        return
    client = redis.Redis.from_url(redis_url)
    namespace = f"test-locks-{uuid.uuid4().hex[:8]}"

    def redis_factory(name: str, ttl: float) -> LeaseLock:
        return RedisLock(name, client, ttl=ttl, namespace=namespace, poll_interval=0.01)

    yield redis_factory
    client.delete(*(client.keys(f"{namespace}:*") or [f"{namespace}:none"]))
    client.close()


def lease_gone(lock: LeaseLock, db: TestDatabase) -> bool:
    """The store no longer holds the lease (its expiry passed there)."""
    if isinstance(lock, RedisLock):
        return not lock.client.exists(lock.key)
    table = schema(db.prefix).locks.name
    with db.engine.connect() as connection:
        return bool(
            connection.execute(
                text(f"SELECT expires_at <= clock_timestamp() FROM {table} WHERE name = :n"),
                {"n": lock.name},
            ).scalar()
        )


def write_stock(db: TestDatabase, count: int, holder: str, token: int) -> int:
    stock = stock_table(db.prefix)
    with db.engine.begin() as connection:
        return fenced_update(
            connection, stock, stock.c.sku == "sku-1", {"count": count, "holder": holder}, token
        )


def stock_row(db: TestDatabase) -> Any:
    stock = stock_table(db.prefix)
    with db.engine.connect() as connection:
        return connection.execute(select(stock).where(stock.c.sku == "sku-1")).one()


def test_a_holder_paused_past_its_lease_has_its_write_refused(
    make_lock: Factory, db: TestDatabase
) -> None:
    paused = make_lock("stock:sku-1", 0.3).acquire(timeout=1)
    # A second holder waits for the first lease to run out (the first holder "pauses").
    other_lock = make_lock("stock:sku-1", 5)
    with pytest.raises(LockTimeoutError, match="not acquired within"):
        other_lock.acquire(timeout=0.05)
    newer = other_lock.acquire(timeout=10)
    assert newer.token > paused.token
    assert write_stock(db, 7, "newer", newer.token) == 1

    # The paused holder wakes up and writes with its old token: refused.
    with pytest.raises(StaleTokenError, match=f"token {paused.token} is stale"):
        write_stock(db, 99, "paused", paused.token)
    row = stock_row(db)
    assert (row.count, row.holder, row.fence_token) == (7, "newer", newer.token)
    paused_lock = make_lock("stock:sku-1", 0.3)
    with pytest.raises(LockLostError):
        paused_lock.extend(paused)
    with pytest.raises(LockLostError):
        paused_lock.release(paused)
    other_lock.release(newer)
    assert make_lock("stock:sku-1", 1).try_acquire() is not None  # released: free again


def test_a_lease_that_ran_out_says_so(make_lock: Factory, db: TestDatabase) -> None:
    lock = make_lock("report", 0.2)
    lease = lock.acquire(timeout=1)
    lease = lock.extend(lease)  # in time: extended
    wait_for(lambda: lease_gone(lock, db), 10, "the lease ran out in the store")
    with pytest.raises(LockExpiredError, match="ran out"):
        lock.extend(lease)


def test_fifty_contenders_hold_the_lock_one_at_a_time_with_increasing_tokens(
    make_lock: Factory, db: TestDatabase
) -> None:
    guard = threading.Lock()
    holding: list[int] = []
    tokens: list[int] = []  # in the order the lock was held
    overlaps: list[tuple[int, ...]] = []
    errors: list[BaseException] = []

    def contend(number: int) -> None:
        try:
            lock = make_lock("stock:sku-1", 10)
            with lock.hold(timeout=60) as lease:
                with guard:
                    holding.append(number)
                    if len(holding) > 1:
                        overlaps.append(tuple(holding))
                    tokens.append(lease.token)
                row = stock_row(db)
                write_stock(db, row.count + 1, str(number), lease.token)
                with guard:
                    holding.remove(number)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)

    assert errors == [] and overlaps == []
    assert len(tokens) == 50 and tokens == sorted(set(tokens))  # strictly increasing
    row = stock_row(db)
    assert row.count == 50 and row.fence_token == tokens[-1]  # no increment lost


def test_an_unreachable_store_is_a_clear_error() -> None:
    engine = create_engine("postgresql+psycopg://nobody:secret@127.0.0.1:1/none")
    with pytest.raises(LockUnavailableError, match="cannot reach PostgreSQL") as caught:
        PostgresLock(engine, "x").try_acquire()
    assert "secret" not in str(caught.value)
    with pytest.raises(LockUnavailableError, match="cannot reach Redis"):
        RedisLock("x", "redis://127.0.0.1:1/0").try_acquire()
