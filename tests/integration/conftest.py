"""Fixtures of the PostgreSQL integration tests at this level (the broker folders below
have their own ``db``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services import TestDatabase, prefixed_database, table_prefix
from tests.support import orders_table


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    """mqdedup's tables and an ``orders`` table under a fresh prefix on PostgreSQL."""
    prefix = table_prefix()
    with prefixed_database(
        pg_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix
    ) as database:
        yield database
