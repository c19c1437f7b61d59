"""Claim cost as the dedup table grows, and purge speed (PostgreSQL).

The dedup table of a private prefix is filled with ``INSERT … SELECT generate_series``
(random-looking md5 ids for the measured consumer, indexes dropped during the fill and
rebuilt after it: the fast way). At each size a claim-only consumer (a bulk handler
that writes nothing, so the transaction is the claim and the commit) processes fresh
UUID ids from the in-memory broker in batches of 500. Then ``DedupStore.purge`` deletes
the oldest rows (one age band per measurement) of the largest table.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Index, text
from sqlalchemy.schema import CreateIndex

from bench.suite_common import Row, Section, Settings, Sizes, progress
from mqdedup import Consumer, InMemoryBroker, Message, create_engine, init_schema, run_until_idle
from mqdedup.consumers.context import BatchContext
from mqdedup.db.schema import schema
from mqdedup.dedup.store import DedupStore

CONSUMER = "bench-claim"


class ClaimOnly(Consumer):
    """Claims its batch and writes nothing else."""

    name = CONSUMER
    batch_size = 500
    poll_timeout = 0.0

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> None:
        return None


def fill(engine: Engine, prefix: str, start: int, stop: int, ages: Sequence[int]) -> float:
    """Add rows ``start`` < g <= ``stop``, indexes dropped during the fill.

    Rows g <= ages[0] are 30 days old, then up to ages[1] 20 days, up to ages[2] 10
    days, the rest 1 hour: one age band per purge measurement.
    """
    table = schema(prefix).processed.name
    started = time.perf_counter()
    with engine.begin() as connection:
        connection.execute(text("SET LOCAL maintenance_work_mem = '512MB'"))
        connection.execute(text(f"ALTER TABLE {table} DROP CONSTRAINT {prefix}processed_pk"))
        connection.execute(text(f"DROP INDEX {prefix}processed_at_brin"))
        connection.execute(
            text(
                f"INSERT INTO {table} (consumer_name, message_id, processed_at) "
                f"SELECT :consumer, md5(g::text), CASE WHEN g <= :a THEN now() - "
                "interval '30 days' WHEN g <= :b THEN now() - interval '20 days' "
                "WHEN g <= :c THEN now() - interval '10 days' ELSE now() - interval '1 hour' "
                "END FROM generate_series(CAST(:start AS bigint), CAST(:stop AS bigint)) g"
            ),
            {
                "consumer": CONSUMER,
                "a": ages[0],
                "b": ages[1],
                "c": ages[2],
                "start": start + 1,
                "stop": stop,
            },
        )
        connection.execute(
            text(
                f"ALTER TABLE {table} ADD CONSTRAINT {prefix}processed_pk "
                "PRIMARY KEY (consumer_name, message_id)"
            )
        )
        connection.execute(CreateIndex(retention_index(prefix)))
    with engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f"VACUUM ANALYZE {table}")
        )
        # Flush the fill's dirty pages now, not during the claim measurements.
        connection.execute(text("CHECKPOINT"))
    return time.perf_counter() - started


def retention_index(prefix: str) -> Index:
    """The dedup table's BRIN index on processed_at (schema 3, PostgreSQL)."""
    indexes = schema(prefix).processed.indexes
    return next(index for index in indexes if index.name == f"{prefix}processed_at_brin")


def delete_in_ctid_chunks(
    engine: Engine,
    table: str,
    condition: str,
    params: dict[str, Any],
    chunk: int,
    order_by: str = "",
) -> int:
    """``DELETE … WHERE ctid = ANY(ARRAY(SELECT ctid … WHERE condition [ORDER BY] LIMIT
    chunk))``, one short transaction per chunk, until a chunk comes back short."""
    order = f" ORDER BY {order_by}" if order_by else ""
    statement = text(
        f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "
        f"WHERE {condition}{order} LIMIT :chunk))"
    )
    total = 0
    while True:
        with engine.begin() as connection:
            deleted = int(connection.execute(statement, {**params, "chunk": chunk}).rowcount)
        total += deleted
        if deleted < chunk:
            return total


def ctid_purge(engine: Engine, prefix: str, older_than: timedelta, chunk: int) -> int:
    """Reference chunked purge (what a set-based DELETE costs): not mqdedup's code."""
    table = schema(prefix).processed.name
    cutoff = datetime.now(UTC) - older_than
    total = delete_in_ctid_chunks(
        engine, table, "processed_at < :cutoff", {"cutoff": cutoff}, chunk
    )
    with engine.connect() as connection:
        left = connection.execute(
            text(f"SELECT count(*) FROM {table} WHERE processed_at < :cutoff"), {"cutoff": cutoff}
        ).scalar_one()
    if left:
        raise RuntimeError(f"reference purge left {left} rows older than the cutoff")
    return total


def claim_rate(engine: Engine, prefix: str, count: int) -> float:
    broker = InMemoryBroker(seed=1)
    for _ in range(count):
        broker.publish("claim", b"{}", message_id=str(uuid.uuid4()))
    consumer_class: Any = type("ClaimOnlyPrefixed", (ClaimOnly,), {"table_prefix": prefix})
    started = time.perf_counter()
    metrics = run_until_idle(consumer_class(), broker.transport("claim"), engine)
    elapsed = time.perf_counter() - started
    if metrics.processed != count:
        raise RuntimeError(f"claim run processed {metrics.processed} of {count}")
    return count / elapsed


def dedup_suite(settings: Settings, sizes: Sizes) -> tuple[Section, Section]:
    """(claim cost by table size, purge speed)."""
    claim = Section(
        "claim",
        "Claim cost as the dedup table grows",
        f"A claim-only consumer (bulk handler writing nothing) on {sizes.claim_messages:,} "
        "fresh UUID ids per run, batches of 500 from the in-memory broker, against a dedup "
        "table already holding N rows of the same consumer (random md5 ids, filled with "
        "`INSERT … SELECT generate_series`). msgs/s = claims committed per second.",
    )
    purge = Section(
        "purge",
        "Purge speed",
        f"Purges of the oldest rows of a {max(sizes.claim_table_sizes):,}-row dedup table, "
        "one age band each: `DedupStore.purge` with its default chunk of 5,000 "
        f"({sizes.purge_default_rows:,} rows), with `chunk_size=100` "
        f"({sizes.purge_small_chunk_rows:,} rows), and for reference a chunked "
        f"`DELETE … WHERE ctid = ANY(ARRAY(SELECT ctid … LIMIT 5000))` ({sizes.purge_rows:,} "
        "rows). `DedupStore.purge` deletes each chunk by the rows' physical addresses "
        "(PostgreSQL `ctid`) found through the BRIN index on `processed_at`, each chunk "
        "resuming after the last row deleted (the reference starts each chunk at the head).",
    )
    engine = create_engine(settings.database_url)
    prefix = f"bench_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    try:
        filled = 0
        ages = (
            sizes.purge_default_rows,
            sizes.purge_default_rows + sizes.purge_small_chunk_rows,
            sizes.purge_default_rows + sizes.purge_small_chunk_rows + sizes.purge_rows,
        )
        if ages[2] > max(sizes.claim_table_sizes):
            raise ValueError("the purge age bands do not fit in the largest table size")
        fill_seconds: dict[int, float] = {}
        for size in sizes.claim_table_sizes:
            if size > filled:
                seconds = fill(engine, prefix, filled, size, ages)
                fill_seconds[size] = seconds
                progress(f"claim: table filled to {size:,} rows in {seconds:.1f} s")
                filled = size
            values = []
            for run in range(1, sizes.runs + 1):
                values.append(claim_rate(engine, prefix, sizes.claim_messages))
                progress(f"claim run {run} at {size:,} rows: {values[-1]:,.0f} msgs/s")
            claim.rows.append(Row(f"{size:,} rows", values, "msgs/s"))
        claim.extra["fill"] = ", ".join(
            f"{size:,} rows in {seconds:.0f} s" for size, seconds in fill_seconds.items()
        )
        store = DedupStore(prefix)
        measurements: list[tuple[str, Callable[[], int]]] = [
            (
                "DedupStore.purge, default chunk_size=5000",
                lambda: store.purge(engine, timedelta(days=25)),
            ),
            (
                "DedupStore.purge, chunk_size=100",
                lambda: store.purge(engine, timedelta(days=15), chunk_size=100),
            ),
            (
                "reference: DELETE by ctid in chunks of 5000 (not mqdedup code)",
                lambda: ctid_purge(engine, prefix, timedelta(days=5), 5000),
            ),
        ]
        for label, measure in measurements:
            started = time.perf_counter()
            deleted = measure()
            elapsed = time.perf_counter() - started
            progress(f"purge: {label}: {deleted:,} rows in {elapsed:.1f} s")
            purge.rows.append(
                Row(label, [deleted / elapsed], "rows/s", f"{deleted:,} rows in {elapsed:.1f} s")
            )
    finally:
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()
    return claim, purge
