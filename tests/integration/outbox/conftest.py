"""Fixtures of the outbox integration tests: the shared PostgreSQL with private tables.

The broker fixtures (``kafka_bootstrap``, ``kafka_helper``, ``rabbitmq_url``, ``rabbit``)
are in ``tests/conftest.py``. Every test gets its own table prefix (outbox, dedup
tables, business table) and its own topics and queues (uuid names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from tests.integration.outbox.helpers import OutboxDb, events_table
from tests.services import prefixed_database, table_prefix


@contextlib.contextmanager
def outbox_db(pg_url: str) -> Iterator[OutboxDb]:
    """Fresh framework tables and business table in the shared PostgreSQL; dropped after."""
    prefix = table_prefix()
    events = events_table(prefix)
    with prefixed_database(pg_url, "PostgreSQL", events.metadata, prefix=prefix) as shared:
        yield OutboxDb(url=shared.url, engine=shared.engine, prefix=prefix, events=events)


@pytest.fixture
def db(pg_url: str) -> Iterator[OutboxDb]:
    """The shared PostgreSQL with this test's own framework tables and business table."""
    with outbox_db(pg_url) as database:
        yield database


@pytest.fixture
def outbox_dbs(pg_url: str) -> Iterator[Callable[[], OutboxDb]]:
    """Table sets like :func:`db`, one per call, for scenarios running side by side."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(outbox_db(pg_url))
