"""A long run of the misuse suite: ``python -m bench.misuse_soak --examples 2000
--database URL``.

The same generated batches and invariant as ``tests/unit/test_misuse.py`` (SQLite) and
``tests/integration/test_misuse_db.py`` (PostgreSQL, MariaDB): handlers that catch
database errors, end the transaction by every route, run DDL, exceed driver limits, raise
from hooks or fail after a step, beside well-behaved batch-mates. Without ``--database`` a
temporary SQLite file is used; the tables get a fresh prefix and are dropped afterwards.

Prints the programs run, the messages by behaviour and fate, the time (median seconds per
program), and every program that broke the invariant with what it broke (exit code 1).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

from mqdedup.db import create_engine
from tests import misuse


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when every program kept the invariant."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--database", default=None, help="default: a temporary SQLite file")
    parser.add_argument("--derandomize", action="store_true", help="the same programs every run")
    parser.add_argument("--stop-at-first", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the run's own dead-letter lines are noise

    with tempfile.TemporaryDirectory() as scratch:
        url = args.database or f"sqlite:///{Path(scratch) / 'misuse.db'}"
        engine = create_engine(url)
        prefix = f"soak_{uuid.uuid4().hex[:8]}_"
        tables = misuse.create_tables(engine, prefix)
        fates: Counter[tuple[str, str]] = Counter()
        seconds: list[float] = []
        broken: list[str] = []
        count = 0

        @settings(
            max_examples=args.examples,
            deadline=None,
            derandomize=args.derandomize,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(scenario=misuse.SCENARIOS)
        def soak(scenario: misuse.Scenario) -> None:
            nonlocal count
            count += 1
            try:
                outcome = misuse.run(engine, tables, f"soak-{count}", scenario)
            except Exception as error:  # the run itself failed (a pool exhausted, say)
                broken.append(f"{misuse.describe(scenario)}\n  the run raised {error!r}")
                if args.stop_at_first:
                    raise AssertionError(broken[-1]) from error
                return
            seconds.append(outcome.seconds)
            for message_id, behaviour in zip(scenario.ids(), scenario.behaviours, strict=True):
                fate = (
                    "processed"
                    if message_id in outcome.claims
                    else "dead"
                    if message_id in outcome.dead
                    else "lost"
                )
                fates[(behaviour, fate)] += 1
            found = misuse.violations(scenario, outcome)
            if found:
                broken.append(misuse.describe(scenario) + "\n  " + "\n  ".join(found))
                if args.stop_at_first:
                    raise AssertionError(broken[-1])

        try:
            soak()
        except AssertionError:
            pass
        finally:
            misuse.drop_tables(engine, prefix)
            engine.dispose()

    print(
        f"database: {engine.dialect.name}  programs: {count}  "
        f"messages: {sum(fates.values())}  broken: {len(broken)}"
    )
    if seconds:
        print(
            f"seconds per program: median {statistics.median(seconds):.3f}, "
            f"max {max(seconds):.2f}, total {sum(seconds):.0f}"
        )
    for behaviour in sorted({b for b, _ in fates}):
        row = ", ".join(
            f"{fate} {fates[(behaviour, fate)]}"
            for fate in ("processed", "dead", "lost")
            if fates[(behaviour, fate)]
        )
        print(f"  {behaviour:<26} {row}")
    for report in broken[:20]:
        print("BROKEN:", report)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
