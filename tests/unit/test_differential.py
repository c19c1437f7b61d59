"""The differential suite on SQLite (see ``tests/differential.py``; issue 28, item 6).

Generated handler programs run through every ``failure_isolation`` and both handler
styles (``handle``, ``handle_batch``) must end exactly as the same statements run by
hand, each message at once in its own transaction, with retries and dead letters:
identical business tables (every row, every column), stored results, dead letters with
their attempt counts, ``on_duplicate`` results and committed messages.

30 examples per isolation mode here; ``python -m bench.differential_soak`` runs
thousands.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from sqlalchemy import Engine

from mqdedup.db import create_engine
from tests import differential
from tests.differential import Scenario, Tables

EXAMPLES = 30


@pytest.fixture(scope="module")
def sqlite_differential(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Tables]]:
    """A SQLite file with the framework's and the differential business tables."""
    path = tmp_path_factory.mktemp("differential") / "differential.db"
    engine = create_engine(f"sqlite:///{path}")
    tables = differential.create_tables(engine, "diff_")
    yield engine, tables
    engine.dispose()


@pytest.mark.parametrize("isolation", differential.ISOLATIONS)
@differential.hypothesis_settings(EXAMPLES)
@given(scenario=differential.SCENARIOS)
def test_handler_programs_end_as_the_reference_on_sqlite(
    sqlite_differential: tuple[Engine, Tables], isolation: str, scenario: Scenario
) -> None:
    engine, tables = sqlite_differential
    differential.assert_matches(engine, tables, scenario, isolation)


def test_the_reference_models_retries_duplicates_and_order(
    sqlite_differential: tuple[Engine, Tables],
) -> None:
    """The reference itself, on a scenario worked out by hand: a running balance across
    a batch, a message failing twice then committing after its batch-mates, one failing
    always (dead-lettered), copies in the batch and in a later batch."""
    engine, tables = sqlite_differential
    ledger = differential.LedgerEntry
    scenario = Scenario(
        ids=("a", "b", "c", "d"),
        programs=(
            differential.Program((ledger(1, 10),)),
            differential.Program((ledger(2, 20), differential.Raise(k=2))),
            differential.Program((ledger(3, 30), differential.Read("ledger"))),
            differential.Program((ledger(4, 40), differential.Raise())),
        ),
        deliveries=(0, 1, 2, 3, 3, 0, 2, 3),
        batch_size=5,
    )
    observed = differential.run_reference(engine, tables, scenario)
    # a, c commit in the first pass; b commits at its third attempt, after them
    assert observed.tables["ledger"] == [(1, "a", 10, 10), (2, "b", 20, 60), (3, "c", 30, 40)]
    assert observed.results == {"a": {"reads": []}, "b": {"reads": []}, "c": {"reads": [[2, 40]]}}
    # d fails 3 times (dead letter) and its copy in the same batch shares that fate; the
    # copy in the next batch runs once more (its 4th counted attempt)
    assert observed.dead == [("d", 3), ("d", 3), ("d", 4)]
    assert observed.duplicates == [("a", '{"reads": []}'), ("c", '{"reads": [[2, 40]]}')]
    assert observed.committed == ["a", "b", "c"]
