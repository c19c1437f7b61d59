"""Fixtures of the RabbitMQ integration tests: private tables and queue names per test.

The broker fixtures (``rabbitmq_url``, ``rabbit``) are in ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import Table

from tests.integration.rabbitmq.support import rabbitmqctl_command
from tests.services import (
    RabbitAdmin,
    TestDatabase,
    prefixed_database,
    require_service,
    table_prefix,
    unique_name,
)
from tests.support import orders_table


@pytest.fixture(scope="session")
def rabbitmqctl() -> list[str]:
    """``rabbitmqctl -n <node>`` for the shared node (``MQDEDUP_RABBITMQCTL``)."""
    command = rabbitmqctl_command()
    if not command:
        require_service("rabbitmqctl", "MQDEDUP_RABBITMQCTL is not set")
    return command


@dataclass(frozen=True)
class Database(TestDatabase):
    """A private table set in the shared PostgreSQL: ``<prefix>*`` framework tables + orders."""

    orders: Table


@pytest.fixture
def db(pg_url: str) -> Iterator[Database]:
    """Own framework tables and business table (prefix ``t_<uuid8>_``), dropped afterwards."""
    prefix = table_prefix()
    orders = orders_table(prefix)
    with prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as shared:
        yield Database(url=shared.url, engine=shared.engine, prefix=prefix, orders=orders)


@pytest.fixture
def queue() -> str:
    """A queue name no other test (or engineer) uses."""
    return unique_name("rabbitmq")


@pytest.fixture
def broker(rabbitmq_url: str, queue: str) -> Iterator[RabbitAdmin]:
    """A pika admin connection to the shared broker; deletes the test's queues afterwards."""
    admin = RabbitAdmin(rabbitmq_url)
    try:
        yield admin
    finally:
        admin.delete(queue, f"{queue}.dlq")
        admin.close()
