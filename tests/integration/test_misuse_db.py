"""The misuse suite on the real PostgreSQL and MariaDB (see ``tests/misuse.py``; issue 39,
item 6): generated batches where some handlers catch database errors with and without a
savepoint, end or replace the transaction by every route, run DDL, exceed the driver's
limits, raise from hooks or fail after a step, beside well-behaved batch-mates. After
every run: each message processed with exactly its effects or dead-lettered with a
reason, batch-mates untouched, the worker alive, the healthy database never waited out.

40 programs on PostgreSQL, 25 on MariaDB here; ``python -m bench.misuse_soak`` runs
thousands.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from sqlalchemy import Engine

from tests import misuse
from tests.services import checked_engine, table_prefix

pytestmark = pytest.mark.integration
PG_EXAMPLES = 40
MARIADB_EXAMPLES = 25
_names = itertools.count()


def _misuse_database(url: str, service: str) -> Iterator[tuple[Engine, misuse.Tables]]:
    engine = checked_engine(url, service)
    prefix = table_prefix()
    tables = misuse.create_tables(engine, prefix)
    try:
        yield engine, tables
    finally:
        misuse.drop_tables(engine, prefix)
        engine.dispose()


@pytest.fixture(scope="module")
def pg_misuse(pg_url: str) -> Iterator[tuple[Engine, misuse.Tables]]:
    """The shared PostgreSQL with this module's tables."""
    yield from _misuse_database(pg_url, "PostgreSQL")


@pytest.fixture(scope="module")
def mariadb_misuse(mariadb_url: str) -> Iterator[tuple[Engine, misuse.Tables]]:
    """The shared MariaDB with this module's tables."""
    yield from _misuse_database(mariadb_url, "MariaDB")


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def _check(engine: Engine, tables: misuse.Tables, scenario: misuse.Scenario) -> None:
    outcome = misuse.run(engine, tables, f"misuse-{next(_names)}", scenario)
    found = misuse.violations(scenario, outcome)
    assert not found, misuse.describe(scenario) + "\n" + "\n".join(found)


@_settings(PG_EXAMPLES)
@given(scenario=misuse.SCENARIOS)
def test_every_message_has_one_fate_whatever_its_batch_mates_do_on_postgresql(
    pg_misuse: tuple[Engine, misuse.Tables], scenario: misuse.Scenario
) -> None:
    _check(*pg_misuse, scenario)


@_settings(MARIADB_EXAMPLES)
@given(scenario=misuse.SCENARIOS)
def test_every_message_has_one_fate_whatever_its_batch_mates_do_on_mariadb(
    mariadb_misuse: tuple[Engine, misuse.Tables], scenario: misuse.Scenario
) -> None:
    _check(*mariadb_misuse, scenario)
