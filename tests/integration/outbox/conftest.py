"""Fixtures of the outbox integration tests: the shared services, private tables per test.

Every test gets its own table prefix (``t_<uuid8>_``: outbox, dedup tables, business
table), its own topics and queues (uuid names), so it runs next to other engineers' test
runs on the shared PostgreSQL, Kafka and RabbitMQ.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from mqdedup.db import check_connection, create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import DatabaseUnavailableError
from tests.conftest import require_service
from tests.integration.outbox.helpers import KafkaTool, OutboxDb, RabbitTool, events_table


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The shared Kafka (``MQDEDUP_KAFKA_BOOTSTRAP``); skipped locally, fails in CI."""
    import kafka
    from kafka.errors import KafkaError

    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    if not bootstrap:
        require_service("Kafka", "MQDEDUP_KAFKA_BOOTSTRAP is not set")
    assert bootstrap is not None
    try:
        kafka.KafkaAdminClient(bootstrap_servers=bootstrap, bootstrap_timeout_ms=5000).close()
    except KafkaError:
        require_service("Kafka", f"no broker answers at {bootstrap}")
    return bootstrap


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """The shared RabbitMQ (``MQDEDUP_RABBITMQ_URL``); skipped locally, fails in CI."""
    import pika
    import pika.exceptions

    url = os.environ.get("MQDEDUP_RABBITMQ_URL")
    if not url:
        require_service("RabbitMQ", "MQDEDUP_RABBITMQ_URL is not set")
    assert url is not None
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except pika.exceptions.AMQPError as error:
        require_service("RabbitMQ", f"cannot connect: {type(error).__name__}")
    return url


@pytest.fixture
def db(pg_url: str) -> Iterator[OutboxDb]:
    """The shared PostgreSQL with this test's own framework tables and business table."""
    engine = create_engine(pg_url)
    try:
        check_connection(engine)
    except DatabaseUnavailableError as error:
        require_service("PostgreSQL", str(error))
    prefix = f"t_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    events = events_table(prefix)
    events.create(engine)
    try:
        yield OutboxDb(url=pg_url, engine=engine, prefix=prefix, events=events)
    finally:
        events.drop(engine, checkfirst=True)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()


@pytest.fixture
def kafka_tool(kafka_bootstrap: str) -> Iterator[KafkaTool]:
    tool = KafkaTool(kafka_bootstrap)
    yield tool
    tool.close()


@pytest.fixture
def rabbit(rabbitmq_url: str) -> Iterator[RabbitTool]:
    tool = RabbitTool(rabbitmq_url)
    yield tool
    tool.close()
