"""Fixtures of the Kafka integration tests: the shared PostgreSQL with a private prefix.

The broker fixtures (``kafka_bootstrap``, ``kafka_helper``) are in ``tests/conftest.py``;
every test gets its own topics (uuid names), consumer groups and table prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services import TestDatabase, prefixed_database, table_prefix
from tests.support import orders_table


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    """Own framework tables and ``<prefix>orders`` in the shared PostgreSQL."""
    prefix = table_prefix()
    with prefixed_database(
        pg_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix
    ) as db:
        yield db
