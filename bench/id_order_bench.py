"""Claims/s on PostgreSQL with time-ordered UUIDv7 vs random UUIDv4 message ids (issue #32).

Raw psycopg, no framework: two tables of mqdedup's ``processed_messages`` shape (primary
key (consumer_name, message_id), BRIN on ``processed_at``), one filled and claimed with
UUIDv4 ids, the other with UUIDv7 ids (:func:`mqdedup.id_generators.new_message_id`). At each
table size (default 0, 1M and 10M rows) both are measured side by side: rounds of
``--claims`` claims of 500 fresh ids (mqdedup's claim statement, one transaction each),
interleaved v4 / v7, medians of ``--rounds``. The tables are grown between sizes by
``INSERT ... SELECT`` with ids made in SQL (v4: ``gen_random_uuid()``; v7: the same
layout as ``new_message_id``, timestamps in the past, one millisecond apart), so the
index grows by the same inserts the ids would make.

Usage: .venv/bin/python bench/id_order_bench.py [--sizes 0,1000000,10000000]
       [--claims 40] [--rounds 5] [--database URL]   (default: MQDEDUP_TEST_DATABASE_URL)
Prints a Markdown table of ids claimed per second (500-id claims) per size and id kind.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench.suite_consumers import psycopg_dsn
from mqdedup.id_generators import new_message_id

BATCH = 500
FILL_CHUNK = 500_000
CREATE = (
    "CREATE TABLE {t} (consumer_name varchar(255) NOT NULL, message_id varchar(255) NOT NULL, "
    "processed_at timestamptz NOT NULL, result jsonb, PRIMARY KEY (consumer_name, message_id))"
)
BRIN = "CREATE INDEX ON {t} USING brin (processed_at) WITH (autosummarize = on)"
CLAIM = (
    "INSERT INTO {t} (consumer_name, message_id, processed_at) "
    "SELECT %s, i, %s FROM unnest(%b::text[]) AS i ORDER BY i "
    "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
)
V4_SQL = "gen_random_uuid()::text"
# UUIDv7 text from a millisecond timestamp ``ms`` and a random v4 for the other bits.
V7_SQL = (
    "substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || '-' "
    "|| substr(r, 20, 17)"
)
FILL = {
    "v4": "INSERT INTO {t} SELECT 'bench', " + V4_SQL + ", now() "
    "FROM generate_series(%s::bigint, %s::bigint - 1) AS g",
    "v7": "INSERT INTO {t} SELECT 'bench', " + V7_SQL + ", now() FROM ("
    "SELECT lpad(to_hex(%s::bigint + g), 12, '0') AS h, gen_random_uuid()::text AS r "
    "FROM generate_series(%s::bigint, %s::bigint - 1) AS g) AS ids",
}


def make_ids(kind: str) -> list[str]:
    if kind == "v4":
        return sorted(str(uuid.uuid4()) for _ in range(BATCH))
    return sorted(new_message_id() for _ in range(BATCH))


def claims_per_second(
    connection: psycopg.Connection[tuple[object, ...]], table: str, kind: str, claims: int
) -> float:
    """Ids claimed per second over ``claims`` claims of 500 fresh ids (ids made untimed)."""
    batches = [make_ids(kind) for _ in range(claims)]
    started = time.perf_counter()
    for ids in batches:
        with connection.transaction():
            now = dt.datetime.now(dt.UTC)
            connection.execute(CLAIM.format(t=table), ("bench", now, ids)).fetchall()
    return claims * BATCH / (time.perf_counter() - started)


def grow(
    connection: psycopg.Connection[tuple[object, ...]],
    table: str,
    kind: str,
    start: int,
    stop: int,
    base_ms: int,
) -> None:
    for low in range(start, stop, FILL_CHUNK):
        high = min(stop, low + FILL_CHUNK)
        if kind == "v4":
            connection.execute(FILL["v4"].format(t=table), (low, high))
        else:
            connection.execute(FILL["v7"].format(t=table), (base_ms, low, high))
    connection.execute(f"VACUUM ANALYZE {table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,1000000,10000000")
    parser.add_argument("--claims", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args()
    if not args.database:
        parser.error("no database: pass --database or set MQDEDUP_TEST_DATABASE_URL")
    sizes = [int(size) for size in args.sizes.split(",")]
    connection = psycopg.connect(psycopg_dsn(args.database), autocommit=True)
    tables = {kind: f"bench_ids_{kind}_{uuid.uuid4().hex[:6]}" for kind in ("v4", "v7")}
    # v7 prefill timestamps: in the past, one per row, ending before the claims start.
    base_ms = time.time_ns() // 1_000_000 - max(sizes) - 60_000
    rows: list[tuple[int, str, float, list[float], float]] = []
    try:
        for table in tables.values():
            connection.execute(CREATE.format(t=table))
            connection.execute(BRIN.format(t=table))
        filled = 0
        for size in sizes:
            for kind, table in tables.items():
                started = time.perf_counter()
                grow(connection, table, kind, filled, size, base_ms)
                print(
                    f"# {kind}: grown to {size:,} rows in {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            filled = size
            results: dict[str, list[float]] = {kind: [] for kind in tables}
            for _ in range(args.rounds):
                for kind, table in tables.items():
                    results[kind].append(claims_per_second(connection, table, kind, args.claims))
            for kind in tables:
                row = (
                    size,
                    kind,
                    statistics.median(results[kind]),
                    results[kind],
                    results["v4"] and statistics.median(results["v4"]),
                )
                rows.append(row)
                print(f"# {size:,} rows {kind}: {row[2]:,.0f} ids/s", file=sys.stderr, flush=True)
        print(
            f"| rows in the table | ids | claims/s (ids, {BATCH}-id claims, median) | vs UUIDv4 "
            "| rounds |"
        )
        print("|---:|---|---:|---:|---|")
        for size, kind, median, values, v4_median in rows:
            rounds = ", ".join(f"{value:,.0f}" for value in values)
            label = "UUIDv4 (random)" if kind == "v4" else "UUIDv7 (`new_message_id`)"
            print(f"| {size:,} | {label} | {median:,.0f} | {median / v4_median:.2f}x | {rounds} |")
    finally:
        for table in tables.values():
            connection.execute(f"DROP TABLE IF EXISTS {table}")
        connection.close()


if __name__ == "__main__":
    main()
