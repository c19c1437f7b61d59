"""The misuse suite on SQLite (see ``tests/misuse.py``; issue 39, item 6): handlers that
catch database errors, end the transaction, run DDL, exceed limits, raise from hooks or
fail after a step never cost a batch-mate its effects, crash the worker or wait out the
healthy database."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from sqlalchemy import Engine

from mqdedup.db import create_engine
from tests import misuse

EXAMPLES = 60
_names = itertools.count()


@pytest.fixture(scope="module")
def sqlite_misuse(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, misuse.Tables]]:
    path: Path = tmp_path_factory.mktemp("misuse") / "misuse.db"
    engine = create_engine(f"sqlite:///{path}")
    tables = misuse.create_tables(engine, "mqdedup_")
    try:
        yield engine, tables
    finally:
        engine.dispose()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenario=misuse.SCENARIOS)
def test_every_message_has_one_fate_whatever_its_batch_mates_do_on_sqlite(
    sqlite_misuse: tuple[Engine, misuse.Tables], scenario: misuse.Scenario
) -> None:
    engine, tables = sqlite_misuse
    outcome = misuse.run(engine, tables, f"misuse-{next(_names)}", scenario)
    found = misuse.violations(scenario, outcome)
    assert not found, misuse.describe(scenario) + "\n" + "\n".join(found)
