"""What the dedup table's shape costs a batch claim on PostgreSQL (issue #11 follow-up).

Raw psycopg, no framework: claims of 500 fresh ids, one transaction each, into four
tables side by side (interleaved rounds, medians):

* mqdedup's ``processed_messages`` shape: primary key (consumer_name, message_id) and a
  btree on ``processed_at`` (what retention's purge scans), the claim mqdedup sends;
* the same with a BRIN index on ``processed_at`` instead of the btree;
* the same with the primary key only (no retention index);
* the hand-written loop's ``seen`` table of ``bench/suite_consumers.py``: one key, no
  retention index, its claim statement.

Usage: .venv/bin/python bench/claim_index_bench.py [--claims 100] [--rounds 5] [--database URL]
(default URL: MQDEDUP_TEST_DATABASE_URL). Prints a Markdown table of ms per claim.
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

BATCH = 500
COMPOSITE = (
    "CREATE TABLE {t} (consumer_name varchar(255) NOT NULL, message_id varchar(255) NOT NULL, "
    "processed_at timestamptz NOT NULL, result jsonb, PRIMARY KEY (consumer_name, message_id))"
)
SHAPES: dict[str, list[str]] = {
    "mqdedup: key (consumer, id) + btree (processed_at)": [
        COMPOSITE,
        "CREATE INDEX ON {t} (processed_at)",
    ],
    "key (consumer, id) + BRIN (processed_at)": [
        COMPOSITE,
        "CREATE INDEX ON {t} USING brin (processed_at)",
    ],
    "key (consumer, id) only": [COMPOSITE],
    "hand-written `seen`: key (id) only": [
        "CREATE TABLE {t} (message_id text PRIMARY KEY, "
        "processed_at timestamptz NOT NULL DEFAULT now())"
    ],
}
MQDEDUP_CLAIM = (
    "INSERT INTO {t} (consumer_name, message_id, processed_at) "
    "SELECT %s, i, %s FROM unnest(%b::text[]) AS i ORDER BY i "
    "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
)
HAND_CLAIM = (
    "INSERT INTO {t} (message_id) SELECT unnest(%s::text[]) "
    "ON CONFLICT DO NOTHING RETURNING message_id"
)


def claim_ms(
    connection: psycopg.Connection[tuple[object, ...]], shape: str, table: str, claims: int
) -> float:
    """Mean ms per claim of ``claims`` batches of fresh ids (id generation not timed)."""
    batches = [sorted(uuid.uuid4().hex for _ in range(BATCH)) for _ in range(claims)]
    started = time.perf_counter()
    for ids in batches:
        with connection.transaction():
            if shape.startswith("hand-written"):
                cursor = connection.execute(HAND_CLAIM.format(t=table), (ids,))
            else:
                now = dt.datetime.now(dt.UTC)
                cursor = connection.execute(MQDEDUP_CLAIM.format(t=table), ("bench", now, ids))
            cursor.fetchall()
    return (time.perf_counter() - started) / claims * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args()
    if not args.database:
        parser.error("no database: pass --database or set MQDEDUP_TEST_DATABASE_URL")
    connection = psycopg.connect(psycopg_dsn(args.database), autocommit=True)
    tables = {shape: f"bench_ci_{uuid.uuid4().hex[:8]}" for shape in SHAPES}
    try:
        for shape, table in tables.items():
            for ddl in SHAPES[shape]:
                connection.execute(ddl.format(t=table))
        results: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        for _ in range(args.rounds):
            for shape, table in tables.items():
                results[shape].append(claim_ms(connection, shape, table, args.claims))
        print(f"| dedup table shape ({BATCH}-id claims) | ms per claim (median) | rounds |")
        print("|---|---:|---|")
        for shape, values in results.items():
            rounds = ", ".join(f"{value:.2f}" for value in values)
            print(f"| {shape} | {statistics.median(values):.2f} | {rounds} |")
    finally:
        for table in tables.values():
            connection.execute(f"DROP TABLE IF EXISTS {table}")
        connection.close()


if __name__ == "__main__":
    main()
