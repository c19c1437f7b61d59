"""The invariant fuzz test on SQLite (see ``tests/fuzz_scenarios.py``).

Hostile ids, headers and bodies, handlers that raise, end the transaction or return
values no database stores, duplicates and crashes: every copy is settled once, as
processed, duplicate or dead-lettered with a reason; no claim without its effects; a
copy is settled only after its claim committed; the worker never raises.

120 examples here (~20 s on the 2-core machine); ``bench/fuzz_soak.py --examples N`` runs longer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import Engine

from mqdedup.db import create_engine
from tests import fuzz_scenarios as fuzz

EXAMPLES = 120
_names = itertools.count()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    path: Path = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    engine = create_engine(f"sqlite:///{path}")
    fuzz.create_tables(engine, "mqdedup_")
    reader = fuzz.reader_for(engine)
    yield engine, reader
    reader.dispose()
    engine.dispose()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(scenario=fuzz.SCENARIOS)
def test_every_message_has_one_fate_and_the_worker_survives(
    engines: tuple[Engine, Engine], scenario: fuzz.Scenario
) -> None:
    engine, reader = engines
    name = f"fuzz-{next(_names)}"
    outcome = fuzz.run(engine, reader, "mqdedup_", name, scenario)
    fuzz.check(scenario, outcome)
