"""Fixtures of the idempotency-tools tests: per-test table prefixes on PostgreSQL and
MariaDB, per-test Redis namespaces, and business tables of their own.

Every test gets its own ``t_<uuid8>_`` prefix for the framework's tables and its own
business tables, so these tests can run next to anyone else's on the shared services.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, select, text

from mqdedup.db.schema import MYSQL_TABLE_OPTIONS, KeyString
from tests.services import prefixed_database, require_service, table_prefix


@dataclass
class Business:
    """A test's own business tables (no unique constraint on message_id on purpose)."""

    metadata: MetaData
    orders: Table
    accounts: Table

    def order_counts(self, engine: Engine) -> dict[str, int]:
        """Business rows per message id."""
        with engine.connect() as connection:
            rows = connection.execute(
                select(self.orders.c.message_id, func.count()).group_by(self.orders.c.message_id)
            ).all()
        return {row[0]: row[1] for row in rows}


@dataclass
class Database:
    """One engine, the test's table prefix and its business tables."""

    engine: Engine
    prefix: str
    business: Business

    def count(self, table: Table) -> int:
        with self.engine.connect() as connection:
            return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def business_tables(prefix: str) -> Business:
    metadata = MetaData()
    orders = Table(
        f"{prefix}orders",
        metadata,
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", KeyString(255), nullable=False),
        Column("order_id", String(64), nullable=True),
        **MYSQL_TABLE_OPTIONS,
    )
    accounts = Table(
        f"{prefix}accounts",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("state", String(20), nullable=False),
        Column("version", Integer, nullable=False),
        **MYSQL_TABLE_OPTIONS,
    )
    return Business(metadata, orders, accounts)


def _database(url: str, service: str) -> Iterator[Database]:
    prefix = table_prefix()
    business = business_tables(prefix)
    with prefixed_database(
        url, service, business.metadata, prefix=prefix, pool_size=10, max_overflow=60
    ) as shared:
        yield Database(shared.engine, prefix, business)


@pytest.fixture
def pg(pg_url: str) -> Iterator[Database]:
    """The shared PostgreSQL, with this test's own tables."""
    yield from _database(pg_url, "PostgreSQL")


@pytest.fixture
def mariadb(mariadb_url: str) -> Iterator[Database]:
    """The shared MariaDB, with this test's own tables."""
    yield from _database(mariadb_url, "MariaDB")


@pytest.fixture(params=["postgresql", "mariadb"])
def database(request: pytest.FixtureRequest) -> Database:
    """Each real database in turn."""
    fixture = "pg" if request.param == "postgresql" else "mariadb"
    return request.getfixturevalue(fixture)  # type: ignore[no-any-return]


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        require_service("Redis", f"{redis_url}: {exc}")
    yield client
    client.close()


@pytest.fixture
def namespace(redis_conn: redis.Redis) -> Iterator[str]:
    """A Redis key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"mqdedup-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(redis_conn.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 1000):
        redis_conn.delete(*keys[start : start + 1000])


def lock_waiters(engine: Engine, table_name: str) -> int:
    """Sessions now blocked while running a statement on ``table_name``.

    PostgreSQL: backends waiting on a lock. MariaDB: other connections with a statement
    on the table in progress (in these tests such a statement only lasts while it waits
    on a row lock). ``INNODB_TRX`` is not used: InnoDB refreshes it only when it was not
    read for 100 ms, so polling it faster keeps serving a stale picture.
    """
    pattern = f"%{table_name}%"
    with engine.connect() as connection:
        if engine.dialect.name == "postgresql":
            query = text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE :pattern"
            )
        else:
            query = text(
                "SELECT count(*) FROM information_schema.PROCESSLIST "
                "WHERE COMMAND = 'Query' AND ID <> CONNECTION_ID() AND INFO LIKE :pattern"
            )
        return int(connection.execute(query, {"pattern": pattern}).scalar_one())
