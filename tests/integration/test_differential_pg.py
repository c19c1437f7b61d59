"""The differential suite on the real PostgreSQL and MariaDB (see ``tests/differential.py``;
issue 28, item 6).

Generated handler programs run through every ``failure_isolation`` and both handler
styles must end exactly as the same statements run by hand, each message at once in
its own transaction, with retries and dead letters: identical business tables, stored
results, dead letters with their attempt counts, ``on_duplicate`` results and committed
messages. PostgreSQL (psycopg) is where write grouping (``unnest``, executemany) and
the driver's own adaptation (a list for a Text column) differ most from SQLite; MariaDB
(PyMySQL) has its own rowcounts and same-table subqueries.

15 examples per isolation mode on PostgreSQL, 8 on MariaDB;
``python -m bench.differential_soak --database URL`` runs thousands.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from sqlalchemy import Engine

from tests import differential
from tests.differential import Scenario, Tables
from tests.services import checked_engine, table_prefix

pytestmark = pytest.mark.integration
PG_EXAMPLES = 15
MARIADB_EXAMPLES = 8


def _differential_database(url: str, service: str) -> Iterator[tuple[Engine, Tables]]:
    engine = checked_engine(url, service)
    prefix = table_prefix()
    tables = differential.create_tables(engine, prefix)
    try:
        yield engine, tables
    finally:
        differential.drop_tables(engine, prefix)
        engine.dispose()


@pytest.fixture(scope="module")
def pg_differential(pg_url: str) -> Iterator[tuple[Engine, Tables]]:
    """The shared PostgreSQL with this module's framework and business tables."""
    yield from _differential_database(pg_url, "PostgreSQL")


@pytest.fixture(scope="module")
def mariadb_differential(mariadb_url: str) -> Iterator[tuple[Engine, Tables]]:
    """The shared MariaDB with this module's framework and business tables."""
    yield from _differential_database(mariadb_url, "MariaDB")


@pytest.mark.parametrize("isolation", differential.ISOLATIONS)
@differential.hypothesis_settings(PG_EXAMPLES)
@given(scenario=differential.SCENARIOS)
def test_handler_programs_end_as_the_reference_on_postgresql(
    pg_differential: tuple[Engine, Tables], isolation: str, scenario: Scenario
) -> None:
    engine, tables = pg_differential
    differential.assert_matches(engine, tables, scenario, isolation)


@pytest.mark.parametrize("isolation", differential.ISOLATIONS)
@differential.hypothesis_settings(MARIADB_EXAMPLES)
@given(scenario=differential.SCENARIOS)
def test_handler_programs_end_as_the_reference_on_mariadb(
    mariadb_differential: tuple[Engine, Tables], isolation: str, scenario: Scenario
) -> None:
    engine, tables = mariadb_differential
    differential.assert_matches(engine, tables, scenario, isolation)
