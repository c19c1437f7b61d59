"""Fixtures of the RabbitMQ integration tests: the shared broker, private tables per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import Engine, Table

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import MqdedupError
from mqdedup.rabbitmq.topology import check_broker
from tests.conftest import require_service
from tests.integration.rabbitmq.support import BrokerAdmin, orders_table, rabbitmqctl_command


@pytest.fixture(scope="session")
def rabbit_url() -> str:
    """The shared RabbitMQ (``MQDEDUP_RABBITMQ_URL``); fails in CI when it is missing."""
    url = os.environ.get("MQDEDUP_RABBITMQ_URL")
    if not url:
        require_service("RabbitMQ", "MQDEDUP_RABBITMQ_URL is not set")
    assert url is not None
    try:
        check_broker(url)
    except MqdedupError as exc:
        require_service("RabbitMQ", str(exc))
    return url


@pytest.fixture(scope="session")
def rabbitmqctl() -> list[str]:
    """``rabbitmqctl -n <node>`` for the shared node (``MQDEDUP_RABBITMQCTL``)."""
    command = rabbitmqctl_command()
    if not command:
        require_service("rabbitmqctl", "MQDEDUP_RABBITMQCTL is not set")
    assert command is not None
    return command


@dataclass
class Database:
    """A private table set in the shared PostgreSQL: ``<prefix>*`` framework tables + orders."""

    engine: Engine
    url: str
    prefix: str
    orders: Table


@pytest.fixture
def db(pg_url: str) -> Iterator[Database]:
    """Own framework tables and business table (prefix ``t_<uuid8>_``), dropped afterwards."""
    from mqdedup.db import check_connection
    from mqdedup.errors import DatabaseUnavailableError

    engine = create_engine(pg_url)
    try:
        check_connection(engine)
    except DatabaseUnavailableError as exc:
        require_service("PostgreSQL", str(exc))
    prefix = f"t_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    orders = orders_table(prefix)
    orders.metadata.create_all(engine)
    try:
        yield Database(engine=engine, url=pg_url, prefix=prefix, orders=orders)
    finally:
        orders.metadata.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()


@pytest.fixture
def queue() -> str:
    """A queue name no other test (or engineer) uses."""
    return f"mqdedup-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def broker(rabbit_url: str, queue: str) -> Iterator[BrokerAdmin]:
    """A pika admin connection to the shared broker; deletes the test's queues afterwards."""
    admin = BrokerAdmin(rabbit_url)
    try:
        yield admin
    finally:
        admin.delete(queue, f"{queue}.dlq")
        admin.close()
