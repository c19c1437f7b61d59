"""What schema 3's BRIN retention index costs the purge on PostgreSQL (issue #11 follow-up).

Two dedup tables side by side (interleaved rounds, medians), each filled with ``--rows``
claims, the older half 30 days old, the newer half 20 days old:

* schema 2: a btree on ``processed_at``, purged as mqdedup 0.x did before schema 3
  (chunks of 5,000 ``ctid`` picked ``ORDER BY processed_at`` through the btree);
* schema 3: mqdedup's table (BRIN on ``processed_at``), purged by ``DedupStore.purge``
  (which also purges the empty attempts table and writes the retention horizon: a few ms).

Two layouts, each purging half the table:

* *fresh*: rows in ``processed_at`` order (a new table): purge the 30-day half;
* *refilled*: after that purge and a VACUUM, new claims refill the freed pages at the
  table's head, then the 20-day half is purged: old and new rows now share block ranges
  (the BRIN summaries widen), as on a table that has been purged before.

Usage: .venv/bin/python bench/purge_index_bench.py [--rows 200000] [--rounds 3]
[--database URL] (default URL: MQDEDUP_TEST_DATABASE_URL). Prints a Markdown table of
seconds per purge and the plan of a schema-3 chunk query on each layout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Engine, text

from bench.suite_dedup import delete_in_ctid_chunks
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.store import DedupStore

CHUNK = 5000


def fill(engine: Engine, table: str, first: int, count: int, age: str) -> None:
    """``count`` claims of one consumer, ``age`` old, in ``processed_at`` order."""
    with engine.begin() as connection:
        connection.execute(
            text(
                f"INSERT INTO {table} (consumer_name, message_id, processed_at) "
                "SELECT 'bench', md5(g::text), now() - CAST(:age AS interval) + g * interval "
                "'1 ms' FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) g"
            ),
            {"age": age, "first": first, "last": first + count - 1},
        )


def vacuum(engine: Engine, table: str) -> None:
    with engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f"VACUUM ANALYZE {table}")
        )


def schema2_purge(engine: Engine, table: str, older_than: timedelta) -> int:
    """The schema-2 purge: ordered chunks through the btree."""
    return delete_in_ctid_chunks(
        engine,
        table,
        "processed_at < now() - CAST(:age AS interval)",
        {"age": f"{older_than.days} days"},
        CHUNK,
        order_by="processed_at",
    )


def plan(engine: Engine, table: str, older_than: timedelta) -> str:
    with engine.connect() as connection:
        rows = connection.execute(
            text(
                f"EXPLAIN SELECT ctid FROM {table} "
                f"WHERE processed_at < now() - interval '{older_than.days} days' LIMIT {CHUNK}"
            )
        ).scalars()
        return " / ".join(row.strip() for row in rows)


def one_round(engine: Engine, rows: int, plans: dict[str, str]) -> dict[tuple[str, str], float]:
    half = rows // 2
    seconds: dict[tuple[str, str], float] = {}
    for version in ("schema 2 (btree)", "schema 3 (BRIN)"):
        prefix = f"pib_{uuid.uuid4().hex[:8]}_"
        init_schema(engine, prefix)
        table = schema(prefix).processed.name
        if version.startswith("schema 2"):
            with engine.begin() as connection:
                connection.execute(text(f"DROP INDEX {prefix}processed_at_brin"))
                connection.execute(
                    text(f"CREATE INDEX {prefix}processed_at_idx ON {table} (processed_at)")
                )
            purge: Callable[[timedelta], int] = partial(schema2_purge, engine, table)
        else:
            purge = partial(DedupStore(prefix).purge, engine, chunk_size=CHUNK)
        try:
            fill(engine, table, 1, half, "30 days")
            fill(engine, table, half + 1, half, "20 days")
            vacuum(engine, table)
            for layout, age, refill in (("fresh", 25, False), ("refilled", 7, True)):
                if refill:
                    vacuum(engine, table)
                    fill(engine, table, rows + 1, half, "1 hour")
                    vacuum(engine, table)
                if version.startswith("schema 3"):
                    plans.setdefault(layout, plan(engine, table, timedelta(days=age)))
                started = time.perf_counter()
                deleted = purge(timedelta(days=age))
                seconds[(version, layout)] = time.perf_counter() - started
                if deleted != half:
                    raise RuntimeError(f"{version} {layout}: deleted {deleted}, expected {half}")
        finally:
            schema(prefix).metadata.drop_all(engine)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args()
    if not args.database:
        parser.error("--database or MQDEDUP_TEST_DATABASE_URL is required")
    engine = create_engine(args.database)
    plans: dict[str, str] = {}
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for key, value in one_round(engine, args.rows, plans).items():
            runs.setdefault(key, []).append(value)
    print(
        f"Purge of {args.rows // 2:,} of {args.rows:,} rows, chunks of {CHUNK:,}, "
        f"medians of {args.rounds} (s)\n"
    )
    print("| table | layout | s (median) | runs |\n|---|---|---:|---|")
    for (version, layout), values in runs.items():
        listed = ", ".join(f"{v:.3f}" for v in values)
        print(f"| {version} | {layout} | {statistics.median(values):.3f} | {listed} |")
    for layout, text_plan in plans.items():
        print(f"\nschema 3 chunk plan, {layout}: {text_plan}")
    engine.dispose()


if __name__ == "__main__":
    main()
