"""Dedup state after N messages, with claims and with offsets in the database (issue 44).

Running 10M messages through Kafka takes too long, so the claims table (the dedup
table of ``init_schema``, its real schema and indexes) is filled the way a consumer with
claims leaves it: one row per message, ``(consumer name, message id, processed_at)``,
ids UUIDv7 strings as :func:`mqdedup.ids.new_message_id` stamps them (made in SQL, in
increasing order, one millisecond apart, timestamps in the past; ``--ids v4``: random
UUIDv4 ids instead, as the issue's earlier figure), written by
``INSERT … SELECT generate_series`` in chunks of 1M rows with the indexes in place (so
the primary key grows as the claims grow it). Then every framework table of the prefix
is listed: rows and ``pg_total_relation_size`` (table + indexes + TOAST).

With offsets in the database and coordinate identity the consumer writes no claims:
its dedup state is one offset row per partition, updated in place, whatever the number
of messages (``bench/kafka_offsets_bench.py`` lists the tables a real run leaves); the
outbox holds only rows not yet relayed (0 here: the handler writes none). Both are
printed side by side.

Claims per second (``--claim-runs`` > 0): a claim-only mqdedup consumer (bulk handler
writing nothing; in-memory broker; batches of 500) claims ``--claims`` fresh ids on the
empty table and again on the full one, ids of the fill's kind, medians. With offsets in
the database the offsets table gets one row per partition (``--partitions``).

Usage::

    eval "$(bash scripts/services.sh env)"
    .venv/bin/python bench/state_size_bench.py                      # 1M rows, ~1 min
    .venv/bin/python bench/state_size_bench.py --rows 10000000      # 10M rows, ~2 min
    .venv/bin/python bench/state_size_bench.py --rows 10000000 --ids v4

Needs ``MQDEDUP_TEST_DATABASE_URL`` (or ``--database``). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Engine, text

from bench.id_order_bench import V7_SQL
from bench.kafka_offsets_bench import framework_state
from bench.suite_dedup import CONSUMER, ClaimOnly
from mqdedup import InMemoryBroker, create_engine, init_schema, run_until_idle
from mqdedup.db.schema import schema
from mqdedup.id_generators import new_message_id

CHUNK = 1_000_000
FILL = {
    "v7": "INSERT INTO {table} (consumer_name, message_id, processed_at) "
    "SELECT :consumer, " + V7_SQL + ", now() FROM ("
    "SELECT lpad(to_hex(CAST(:base AS bigint) + g), 12, '0') AS h, "
    "gen_random_uuid()::text AS r "
    "FROM generate_series(CAST(:low AS bigint), CAST(:high AS bigint) - 1) AS g) AS ids",
    # Random UUIDv4 ids (the 36.5k-at-10M figure was measured on random ids).
    "v4": "INSERT INTO {table} (consumer_name, message_id, processed_at) "
    "SELECT :consumer, gen_random_uuid()::text, now() "
    "FROM generate_series(CAST(:low AS bigint), CAST(:high AS bigint) - 1) AS g "
    "WHERE CAST(:base AS bigint) IS NOT NULL",
}


def fill(engine: Engine, prefix: str, rows: int, kind: str) -> float:
    """``rows`` claims of :data:`CONSUMER` with ``kind`` ids; returns the seconds taken."""
    table = schema(prefix).processed.name
    base_ms = time.time_ns() // 1_000_000 - rows - 3_600_000
    started = time.perf_counter()
    for low in range(0, rows, CHUNK):
        high = min(rows, low + CHUNK)
        with engine.begin() as connection:
            connection.execute(
                text(FILL[kind].format(table=table)),
                {"consumer": CONSUMER, "base": base_ms, "low": low, "high": high},
            )
        print(f"# filled {high:,} rows ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    with engine.connect() as connection:
        autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
        autocommit.execute(text(f"VACUUM ANALYZE {table}"))
        autocommit.execute(text("CHECKPOINT"))
    return time.perf_counter() - started


def claim_rate(engine: Engine, prefix: str, count: int, make_id: Callable[[], str]) -> float:
    """Claims per second of the claim-only consumer over ``count`` fresh ids."""
    broker = InMemoryBroker(seed=1)
    for _ in range(count):
        broker.publish("claim", b"{}", message_id=make_id())
    consumer_class: Any = type("ClaimOnlyPrefixed", (ClaimOnly,), {"table_prefix": prefix})
    started = time.perf_counter()
    metrics = run_until_idle(consumer_class(), broker.transport("claim"), engine)
    elapsed = time.perf_counter() - started
    if metrics.processed != count:
        raise RuntimeError(f"claim run processed {metrics.processed} of {count}")
    return count / elapsed


IDS: dict[str, tuple[str, Callable[[], str]]] = {
    "v7": ("UUIDv7 (`new_message_id`)", new_message_id),
    "v4": ("UUIDv4 (random)", lambda: str(uuid.uuid4())),
}


def claim_rates(engine: Engine, prefix: str, count: int, runs: int, kind: str) -> list[float]:
    """Claims/s of ``runs`` runs, fresh ids of ``kind`` (the fill's kind: a claim of
    the other kind would land at one end of the index, not where real claims go)."""
    return [claim_rate(engine, prefix, count, IDS[kind][1]) for _ in range(runs)]


def offset_rows(engine: Engine, prefix: str, partitions: int, rows: int) -> None:
    """The offsets table as a consumer with offsets in the database leaves it after
    ``rows`` messages: one row per partition (if this tree's schema has the table)."""
    table = schema(prefix).metadata.tables.get(f"{prefix}kafka_offsets")
    if table is None:
        return
    with engine.begin() as connection:
        connection.execute(
            table.insert(),
            [
                {
                    "group_id": CONSUMER,
                    "topic": "orders",
                    "partition": partition,
                    "next_offset": rows // partitions,
                    "owner_epoch": 1,
                    "done_above": None,
                    "updated_at": datetime.now(UTC),
                }
                for partition in range(partitions)
            ],
        )


def size(value: int) -> str:
    return f"{value / 1024 / 1024:,.1f} MiB" if value >= 1024 * 1024 else f"{value / 1024:,.0f} kB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="messages (claims) to fill")
    parser.add_argument("--partitions", type=int, default=3, help="for the offsets table rows")
    parser.add_argument("--claims", type=int, default=20_000, help="ids per claims/s run")
    parser.add_argument("--claim-runs", type=int, default=3, help="0: skip claims/s")
    parser.add_argument("--ids", choices=sorted(IDS), default="v7", help="fill/claim ids")
    parser.add_argument("--keep", action="store_true", help="keep the filled tables")
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args(argv)
    if not args.database or not args.database.startswith("postgresql"):
        parser.error("set MQDEDUP_TEST_DATABASE_URL (or --database) to a PostgreSQL URL")
    if args.rows < 0 or args.partitions < 1 or args.claims < 1 or args.claim_runs < 0:
        parser.error("--rows >= 0, --partitions, --claims >= 1, --claim-runs >= 0")
    engine = create_engine(args.database)
    prefix = f"bench_state_{uuid.uuid4().hex[:6]}_"
    init_schema(engine, prefix)
    try:
        empty: list[float] = []
        empty_sizes: dict[str, int] = {}
        if args.claim_runs:
            empty = claim_rates(engine, prefix, args.claims, args.claim_runs, args.ids)
            with engine.begin() as connection:  # measure the size of exactly --rows claims
                connection.execute(text(f"TRUNCATE {schema(prefix).processed.name}"))
        empty_sizes = {name: total for name, _, total in framework_state(engine, prefix)}
        if not empty_sizes:
            empty_sizes = {name: total for name, _, total in framework_state(engine, prefix)}
        seconds = fill(engine, prefix, args.rows, args.ids)
        offset_rows(engine, prefix, args.partitions, args.rows)
        state = framework_state(engine, prefix)
        full: list[float] = []
        if args.claim_runs:
            full = claim_rates(engine, prefix, args.claims, args.claim_runs, args.ids)
        with engine.connect() as connection:
            processed = schema(prefix).processed.name
            heap, indexes = connection.execute(
                text(
                    "SELECT pg_relation_size(CAST(:t AS regclass)), "
                    "pg_indexes_size(CAST(:t AS regclass))"
                ),
                {"t": processed},
            ).one()
            settings: dict[str, str] = dict(
                connection.execute(
                    text(
                        "SELECT name, current_setting(name) FROM pg_settings "
                        "WHERE name IN ('shared_buffers', 'server_version')"
                    )
                ).all()
            )
    finally:
        if not args.keep:
            schema(prefix).metadata.drop_all(engine)
        engine.dispose()

    print(
        f"\nDedup state after {args.rows:,} messages ({args.partitions} partitions), "
        f"PostgreSQL {settings.get('server_version')}, shared_buffers "
        f"{settings.get('shared_buffers')}; claims table filled in {seconds:.0f} s\n"
    )
    print("| table | with claims: rows | size | offsets in the database: rows | size |")
    print("|---|---:|---:|---:|---:|")
    offsets_row = False
    for name, rows, total in state:
        if name == "processed_messages":
            print(
                f"| claims (`{name}`) | {rows:,} | {size(total)} | 0 | {size(empty_sizes[name])} |"
            )
        elif "offset" in name:
            offsets_row = True
            print(
                f"| offsets (`{name}`) | 0 | {size(empty_sizes[name])} | {rows:,} | {size(total)} |"
            )
        elif name.startswith("outbox"):
            print(f"| {name} | {rows:,} | {size(total)} | {rows:,} | {size(total)} |")
    if not offsets_row:
        print(
            f"| offsets (not in this tree's schema) | - | - | {args.partitions} "
            "| one row per partition |"
        )
    print(
        f"\nClaims table: heap {size(heap)}, indexes {size(indexes)} (primary key "
        "(consumer_name, message_id) and the BRIN on processed_at); "
        f"{(heap + indexes) / max(args.rows, 1):.0f} bytes per message."
    )
    if args.claim_runs:
        print(
            f"\nClaims/s (claim-only mqdedup consumer, in-memory broker, batches of 500, "
            f"{args.claims:,} fresh ids per run, medians of {args.claim_runs})\n"
        )
        print(f"| ids | empty table | runs | at {args.rows:,} rows | runs | ratio |")
        print("|---|---:|---|---:|---|---:|")
        low, high = statistics.median(empty), statistics.median(full)
        print(
            f"| {IDS[args.ids][0]} | {low:,.0f} | {', '.join(f'{v:,.0f}' for v in empty)} "
            f"| {high:,.0f} | {', '.join(f'{v:,.0f}' for v in full)} | {high / low:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
