"""A long run of the invariant fuzz test: ``python -m bench.fuzz_soak --examples 2000``.

The same generated scenarios and checks as ``tests/unit/test_invariants_fuzz.py``
(SQLite, 120 examples) and ``tests/integration/test_invariants_fuzz_pg.py``
(PostgreSQL, 100 examples), with as many examples as asked. Pass ``--database-url``
for PostgreSQL or MariaDB (the tables get a fresh prefix and are dropped afterwards);
without it a temporary SQLite file is used. Prints the examples run, the time, and the
smallest failing scenario if a promise broke (exit code 1).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from mqdedup.db import create_engine
from tests import fuzz_scenarios as fuzz


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--database-url", default=None, help="default: a temporary SQLite file")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)

    with tempfile.TemporaryDirectory() as folder:
        url = options.database_url or f"sqlite:///{Path(folder) / 'soak.db'}"
        engine = create_engine(url)
        prefix = f"soak_{uuid.uuid4().hex[:8]}_"
        fuzz.create_tables(engine, prefix)
        reader = fuzz.reader_for(engine)
        names = itertools.count()
        ran = itertools.count(1)

        @settings(
            max_examples=options.examples,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(scenario=fuzz.SCENARIOS)
        def soak(scenario: fuzz.Scenario) -> None:
            next(ran)
            outcome = fuzz.run(engine, reader, prefix, f"soak-{next(names)}", scenario)
            fuzz.check(scenario, outcome)

        started = time.monotonic()
        failed = False
        try:
            soak()
        except Exception as error:
            failed = True
            print(f"promise broken: {type(error).__name__}: {error}", file=sys.stderr)
        finally:
            elapsed = time.monotonic() - started
            if reader is not engine:
                reader.dispose()
            fuzz.drop_tables(engine, prefix)
            engine.dispose()
    examples = next(ran) - 1
    print(
        f"{examples} scenarios on {engine.dialect.name} in {elapsed:.0f} s: "
        f"{'FAILED' if failed else 'all promises held'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
