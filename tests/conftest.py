"""The service fixtures of every suite (the building blocks live in ``tests/services.py``).

SQLite for unit tests; the shared PostgreSQL, MariaDB, Redis, Kafka and RabbitMQ for the
contract, integration and acceptance tests. A missing service skips locally and fails
in CI. Each test gets fresh topics, queues and table prefixes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from mqdedup.db import create_engine
from tests import services
from tests.services import (
    KafkaHelper,
    PrivateRabbitMQ,
    RabbitAdmin,
    TestDatabase,
    checked_engine,
    prefixed_database,
    table_prefix,
)
from tests.support import orders_table, reset_database

# -- databases -------------------------------------------------------------------------------


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'test.db'}")
    reset_database(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The shared PostgreSQL (``MQDEDUP_TEST_DATABASE_URL``)."""
    return services.service_env(services.PG_URL_ENV, "PostgreSQL")


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    """The shared PostgreSQL with the unprefixed tables recreated (``tests.support``)."""
    engine = checked_engine(pg_url, "PostgreSQL")
    reset_database(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    """mqdedup's tables and ``<prefix>orders`` under a fresh prefix in the shared
    PostgreSQL (the outbox and RabbitMQ folders have a ``db`` of their own)."""
    prefix = table_prefix()
    with prefixed_database(
        pg_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix
    ) as database:
        yield database


@pytest.fixture(scope="session")
def mariadb_url() -> str:
    """The shared MariaDB (``MQDEDUP_TEST_MARIADB_URL``)."""
    return services.service_env(services.MARIADB_URL_ENV, "MariaDB")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The shared Redis (``MQDEDUP_REDIS_URL``)."""
    return services.service_env(services.REDIS_URL_ENV, "Redis")


# -- brokers ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The shared Kafka (``MQDEDUP_KAFKA_BOOTSTRAP``), checked to answer."""
    return services.kafka_bootstrap()


@pytest.fixture
def kafka_helper(kafka_bootstrap: str) -> Iterator[KafkaHelper]:
    """Topics on the shared Kafka; those this helper created are deleted at the end."""
    helper = KafkaHelper(kafka_bootstrap)
    yield helper
    helper.close()


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """The shared RabbitMQ (``MQDEDUP_RABBITMQ_URL``), checked to answer."""
    return services.rabbitmq_url()


@pytest.fixture
def rabbit(rabbitmq_url: str) -> Iterator[RabbitAdmin]:
    """An admin connection to the shared RabbitMQ; queues it made are deleted at the end."""
    admin = RabbitAdmin(rabbitmq_url)
    yield admin
    admin.close()


@pytest.fixture(scope="session")
def _private_rabbitmq_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRabbitMQ]:
    """One PRIVATE RabbitMQ node for the whole run (a node start costs seconds)."""
    with services.private_rabbitmq(tmp_path_factory.mktemp("private-rabbitmq")) as node:
        yield node


@pytest.fixture
def private_rabbit(_private_rabbitmq_node: PrivateRabbitMQ) -> Iterator[PrivateRabbitMQ]:
    """A PRIVATE RabbitMQ node (never the shared one) for tests that stop or kill it, or
    change its settings: running when the test starts, and afterwards running again with
    its own settings (``set_env`` undone, no memory alarm) for the next test. Tests use
    fresh queue names on it like on the shared node."""
    _private_rabbitmq_node.ensure_running()
    yield _private_rabbitmq_node
    _private_rabbitmq_node.reset()
