"""Fixtures for the Kafka integration tests: the real broker, a private table prefix.

Every test gets its own topics (uuid names), consumer groups and table prefix, so the
tests run next to other engineers' test runs on the shared services.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine

from mqdedup.db import check_connection, create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import DatabaseUnavailableError
from tests.conftest import require_service
from tests.integration.kafka.consumers import orders_table
from tests.integration.kafka.helpers import KafkaHelper
from tests.services import PrivateService, free_port


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The shared broker (``MQDEDUP_KAFKA_BOOTSTRAP``); skipped locally, fails in CI."""
    import kafka
    from kafka.errors import KafkaError

    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    if not bootstrap:
        require_service("Kafka", "MQDEDUP_KAFKA_BOOTSTRAP is not set")
    assert bootstrap is not None
    try:
        admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, bootstrap_timeout_ms=5000)
    except KafkaError:
        require_service("Kafka", f"no broker answers at {bootstrap}")
    admin.close()
    return bootstrap


@pytest.fixture
def kafka_helper(kafka_bootstrap: str) -> Iterator[KafkaHelper]:
    helper = KafkaHelper(kafka_bootstrap)
    yield helper
    helper.close()


@dataclass(frozen=True)
class TestDatabase:
    """The shared PostgreSQL with this test's own table prefix."""

    __test__ = False
    url: str
    engine: Engine
    prefix: str


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    engine = create_engine(pg_url)
    try:
        check_connection(engine)
    except DatabaseUnavailableError as exc:
        require_service("PostgreSQL", str(exc))
    prefix = f"t_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    orders_table(prefix).create(engine)
    yield TestDatabase(url=pg_url, engine=engine, prefix=prefix)
    orders_table(prefix).drop(engine, checkfirst=True)
    schema(prefix).metadata.drop_all(engine)
    engine.dispose()


@pytest.fixture
def private_kafka(kafka_bootstrap: str, tmp_path: Path) -> Iterator[PrivateService]:
    """A PRIVATE Kafka broker (own port and state dir) that a test may stop and start.

    The shared broker on the default port is never touched. The instance is stopped at
    the end, and killed if it does not stop (also when its start failed half-way).
    """
    port = free_port()
    while port >= 65000:  # its controller listens on port + 1
        port = free_port()
    broker = PrivateService("kafka", tmp_path / "services", "KAFKA_PORT", port)
    try:
        broker.start()
        yield broker
    finally:
        try:
            broker.stop()
        except Exception:
            with contextlib.suppress(Exception):
                broker.kill()
