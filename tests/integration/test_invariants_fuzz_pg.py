"""The invariant fuzz test on the real PostgreSQL (see ``tests/fuzz_scenarios.py``).

PostgreSQL is where hostile content used to crash a worker (NUL bytes and lone
surrogates in ids and results, JSONB refusing NaN): every copy must still be settled
once, as processed, duplicate or dead-lettered with a reason; no claim without its
effects; settled only after its claim committed; the worker never raises.

100 examples here (~20 s); ``bench/fuzz_soak.py --database-url … --examples N`` runs
longer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import Engine

from tests import fuzz_scenarios as fuzz
from tests.services import checked_engine, table_prefix

pytestmark = pytest.mark.integration
EXAMPLES = 100
_names = itertools.count()


@pytest.fixture(scope="module")
def pg_fuzz(pg_url: str) -> Iterator[tuple[Engine, str]]:
    engine = checked_engine(pg_url, "PostgreSQL")
    prefix = table_prefix()
    fuzz.create_tables(engine, prefix)
    try:
        yield engine, prefix
    finally:
        fuzz.drop_tables(engine, prefix)
        engine.dispose()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(scenario=fuzz.SCENARIOS)
def test_every_message_has_one_fate_on_postgresql(
    pg_fuzz: tuple[Engine, str], scenario: fuzz.Scenario
) -> None:
    engine, prefix = pg_fuzz
    outcome = fuzz.run(engine, engine, prefix, f"fuzz-{next(_names)}", scenario)
    fuzz.check(scenario, outcome)
