"""A long run of the differential suite: ``python -m bench.differential_soak --examples 2000
--database URL``.

The same generated handler programs, reference and comparison as
``tests/unit/test_differential.py`` (SQLite) and ``tests/integration/test_differential_pg.py``
(PostgreSQL, MariaDB), with as many examples as asked, each through every
``failure_isolation`` and both handler styles. Without ``--database`` a temporary
SQLite file is used; the tables get a fresh prefix and are dropped afterwards.

Prints the examples run, the framework runs, what the examples exercised (dead
letters, duplicates, staged rows, ...), the time, and every scenario that differed with
its differences (exit code 1). ``--stop-at-first`` stops at the first difference;
``--shrink`` then lets Hypothesis minimise it first (slow: each try runs every mode).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from hypothesis import given

from mqdedup.db import create_engine
from tests import differential
from tests.differential import Scenario


class DifferenceFoundError(AssertionError):
    """A scenario on which mqdedup and the reference differ."""


def features(scenario: Scenario) -> set[str]:
    """What a scenario exercises (for the counts printed at the end)."""
    found = {type(op).__name__ for program in scenario.programs for op in program.ops}
    if len(scenario.deliveries) > len(scenario.ids):
        found.add("copies")
    if len(scenario.deliveries) > scenario.batch_size:
        found.add("several batches")
    if any(
        isinstance(op, differential.StageRow) and op.bad
        for program in scenario.programs
        for op in program.ops
    ):
        found.add("failing staged row")
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when every scenario matched the reference."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--database", default=None, help="default: a temporary SQLite file")
    parser.add_argument("--isolation", action="append", choices=differential.ISOLATIONS)
    parser.add_argument("--style", action="append", choices=differential.STYLES)
    parser.add_argument("--stop-at-first", action="store_true")
    parser.add_argument("--shrink", action="store_true", help="minimise the first difference")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger("psycopg").setLevel(logging.CRITICAL)  # aborted pipelines, expected
    isolations = options.isolation or list(differential.ISOLATIONS)
    styles = options.style or list(differential.STYLES)
    stop_at_first = options.stop_at_first or options.shrink

    examples = 0
    runs = 0
    exercised: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    differing: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        url = options.database or f"sqlite:///{Path(folder) / 'differential.db'}"
        engine = create_engine(url)
        prefix = f"soak_{uuid.uuid4().hex[:8]}_"
        tables = differential.create_tables(engine, prefix)

        @differential.hypothesis_settings(options.examples, shrink=options.shrink)
        @given(scenario=differential.SCENARIOS)
        def soak(scenario: Scenario) -> None:
            nonlocal examples, runs
            examples += 1
            exercised.update(features(scenario))
            expected = differential.run_reference(engine, tables, scenario)
            outcomes["dead letters"] += len(expected.dead)
            outcomes["duplicates"] += len(expected.duplicates)
            outcomes["processed"] += len(expected.committed)
            found: list[str] = []
            for isolation in isolations:
                for style in styles:
                    runs += 1
                    actual = differential.run_framework(engine, tables, scenario, isolation, style)
                    found.extend(
                        f"[{isolation}/{style}] {line}"
                        for line in differential.differences(expected, actual)
                    )
            if found:
                report = differential.failure_report(scenario, found)
                differing.append(report)
                if stop_at_first:
                    raise DifferenceFoundError(report)

        started = time.monotonic()
        try:
            soak()
        except DifferenceFoundError:
            pass  # kept in ``differing`` (the shrunk one last)
        finally:
            elapsed = time.monotonic() - started
            differential.drop_tables(engine, prefix)
            engine.dispose()
    if options.shrink:
        differing = differing[-1:]  # Hypothesis replays the smallest one last
    for report in differing[:20]:
        print(report, end="\n\n")
    print(
        f"{examples} examples, {runs} framework runs ({len(isolations)} isolation modes x "
        f"{len(styles)} handler styles) on {engine.dialect.name} in {elapsed:.0f} s"
    )
    print("reference outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print(
        "examples exercising: "
        + ", ".join(f"{name} {count}" for name, count in sorted(exercised.items()))
    )
    verdict = "all matched the reference" if not differing else f"{len(differing)} DIFFERED"
    print(f"result: {verdict}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
