"""Wrong argument types to the locks are clear errors at the call (issue #39).

Each names the argument and what it must be, before any statement or connection;
before, most were an AttributeError or TypeError from deep inside SQLAlchemy or redis.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, select

from mqdedup.db.engine import create_engine
from mqdedup.locks import Lease, PostgresLock, RedisLock, fenced_update

stock = Table(
    "stock",
    MetaData(),
    Column("sku", String(64), primary_key=True),
    Column("count", Integer),
    Column("fence_token", BigInteger),
)
PG_URL = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # never connected to


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"engine": PG_URL}, TypeError, "engine must be a SQLAlchemy Engine"),
        ({"name": 42}, TypeError, "lock name must be a string, got int"),
        ({"name": ""}, ValueError, "lock name must be 1 to 255 characters"),
        ({"ttl": "5"}, TypeError, "ttl must be a number of seconds, got str"),
        ({"ttl": 0}, ValueError, "ttl must be 0.001 to 86400 seconds"),
        ({"poll_interval": None}, TypeError, "poll_interval must be a number of seconds"),
        ({"prefix": 3}, TypeError, "prefix must be a string, got int"),
    ],
)
def test_postgres_lock_arguments(arguments: dict[str, Any], error: type, message: str) -> None:
    given: dict[str, Any] = {"engine": create_engine(PG_URL), "name": "stock", **arguments}
    with pytest.raises(error, match=message):
        PostgresLock(given.pop("engine"), given.pop("name"), **given)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"name": b"stock"}, TypeError, "lock name must be a string, got bytes"),
        ({"client": 6379}, TypeError, "client must be a redis.Redis, a redis:// URL or None"),
        ({"namespace": None}, TypeError, "namespace must be a string, got NoneType"),
        ({"ttl": [5]}, TypeError, "ttl must be a number of seconds, got list"),
        ({"poll_interval": -1}, ValueError, "poll_interval must be more than 0 seconds"),
    ],
)
def test_redis_lock_arguments(arguments: dict[str, Any], error: type, message: str) -> None:
    given: dict[str, Any] = {"name": "stock", "client": "redis://127.0.0.1:1/0", **arguments}
    with pytest.raises(error, match=message):
        RedisLock(given.pop("name"), given.pop("client"), **given)


def test_lease_and_timeout_arguments() -> None:
    lock = RedisLock("stock", "redis://127.0.0.1:1/0")  # connects lazily: never here
    with pytest.raises(TypeError, match="lease must be the Lease that acquire"):
        lock.release(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease is of lock 'other'"):
        lock.extend(Lease("other", "owner", 1, 5.0, 0.0))
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got str"):
        lock.acquire("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be 0 seconds or more"):
        lock.acquire(-1)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"session": "sqlite://"}, TypeError, "session must be a SQLAlchemy Session or Connection"),
        ({"table": "stock"}, TypeError, "table must be a SQLAlchemy Table, got str"),
        ({"where": "sku = 'a'"}, TypeError, "where must be a SQLAlchemy condition"),
        ({"where": True}, TypeError, "where must be a SQLAlchemy condition"),
        ({"values": [("count", 1)]}, TypeError, "values must be a mapping"),
        ({"values": {"cuont": 1}}, ValueError, "has no column 'cuont'"),
        ({"token": "7"}, TypeError, "token must be an int \\(lease.token\\), got str"),
        ({"token": True}, TypeError, "token must be an int"),
        ({"fence_column": "fence"}, ValueError, "has no column 'fence'"),
        ({"fence_column": 1}, TypeError, "fence_column must be a column name"),
    ],
)
def test_fenced_update_arguments(arguments: dict[str, Any], error: type, message: str) -> None:
    engine = create_engine("sqlite://")
    stock.metadata.create_all(engine)
    with engine.begin() as connection:
        given: dict[str, Any] = {
            "session": connection,
            "table": stock,
            "where": stock.c.sku == "a",
            "values": {"count": 1},
            "token": 7,
            **arguments,
        }
        with pytest.raises(error, match=message):
            fenced_update(**given)
        assert connection.execute(select(stock)).all() == []  # nothing ran
