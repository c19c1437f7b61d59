"""Worker memory over a long run: peak RSS of a worker subprocess.

The worker subprocess (``python -m bench.suite_memory --worker``) runs an mqdedup bulk
consumer (claim + one ``unnest`` INSERT per batch of 500) on PostgreSQL, fed by the
in-memory broker through a transport that publishes the next messages only when the
queue runs low, so the broker never holds more than a few thousand messages and the
RSS is the worker's own. It prints its RSS (``/proc/self/status`` VmRSS) every
``--every`` messages and ``resource.getrusage`` ``ru_maxrss`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench.suite_common import Row, Section, Settings, Sizes, progress

ROOT = Path(__file__).resolve().parent.parent


def vm_kib(field: str = "VmRSS") -> int:
    """A ``/proc/self/status`` memory field in KiB (VmRSS now, VmHWM the peak so far)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def sample(processed: int, seconds: float) -> str:
    return json.dumps(
        {"processed": processed, "rss_kib": vm_kib(), "hwm_kib": vm_kib("VmHWM"), "s": seconds}
    )


def worker(database_url: str, messages: int, every: int) -> int:
    from sqlalchemy import text

    from mqdedup import Consumer, InMemoryBroker, Message, Worker, create_engine, init_schema
    from mqdedup.consumers.context import BatchContext
    from mqdedup.consumers.memory import MemoryTransport
    from mqdedup.consumers.transport import Delivery
    from mqdedup.db.schema import schema

    prefix = f"bench_mem_{uuid.uuid4().hex[:8]}_"
    orders = f"{prefix}orders"
    engine = create_engine(database_url)
    init_schema(engine, prefix)
    with engine.begin() as connection:
        connection.execute(
            text(
                f"CREATE TABLE {orders} (row_id bigserial PRIMARY KEY, "
                "message_id text NOT NULL, n integer NOT NULL)"
            )
        )

    class Feeding(MemoryTransport):
        """Publishes the next chunk when the queue runs low."""

        published = 0

        def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
            if self.broker.pending(self.queue) < max_messages and self.published < messages:
                chunk = min(max_messages * 4, messages - self.published)
                for number in range(self.published, self.published + chunk):
                    self.broker.publish(
                        self.queue, b'{"n": %d}' % number, message_id=f"mem-{number:09d}"
                    )
                self.published += chunk
            return super().fetch(max_messages, timeout)

    state = {"done": 0, "next": every, "started": time.perf_counter()}

    class Bulk(Consumer):
        name = "bench-memory"
        table_prefix = prefix
        batch_size = 500
        poll_timeout = 0.0

        def handle_batch(self, batch: Sequence[Message], ctx: BatchContext) -> None:
            ctx.session.execute(
                text(
                    f"INSERT INTO {orders} (message_id, n) SELECT * FROM "
                    "unnest(CAST(:ids AS text[]), CAST(:ns AS integer[]))"
                ),
                {"ids": [m.id for m in batch], "ns": [m.json()["n"] for m in batch]},
            )

        def after_commit(self, batch: Sequence[Message]) -> None:
            state["done"] += len(batch)
            if state["done"] >= state["next"]:
                state["next"] += every
                elapsed = time.perf_counter() - state["started"]
                print(sample(int(state["done"]), elapsed), flush=True)

    print(sample(0, 0.0), flush=True)
    broker = InMemoryBroker()
    try:
        state["started"] = time.perf_counter()
        metrics = Worker(Bulk(), Feeding(broker, "memory"), engine).run(until_idle=True)
        elapsed = time.perf_counter() - state["started"]
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP TABLE IF EXISTS {orders}"))
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(
        json.dumps(
            {"final": True, "processed": metrics.processed, "ru_maxrss_kib": maxrss, "s": elapsed}
        ),
        flush=True,
    )
    return 0 if metrics.processed == messages else 1


def memory_suite(settings: Settings, sizes: Sizes) -> Section:
    """Run the worker subprocess and report peak RSS, RSS growth and throughput."""
    n = sizes.memory_messages
    section = Section(
        "memory",
        "Worker memory over a long run",
        f"One worker subprocess (mqdedup bulk consumer, batches of 500, claim + one INSERT "
        f"per batch on PostgreSQL) processing {n:,} messages from the in-memory broker "
        "(fed as the queue runs low, so the broker holds at most a few thousand messages). "
        "RSS and its peak (VmRSS, VmHWM) sampled from /proc/self/status during the run; "
        "`resource.getrusage(RUSAGE_SELF).ru_maxrss` read at exit (after teardown).",
    )
    every = max(1000, n // 50)
    command = [
        sys.executable,
        "-m",
        "bench.suite_memory",
        "--worker",
        "--messages",
        str(n),
        "--every",
        str(every),
        "--database",
        settings.database_url,
    ]
    started = time.perf_counter()
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"memory worker failed ({result.returncode}): {result.stderr[-2000:]}")
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    samples = [(line["processed"], line["rss_kib"] / 1024) for line in lines if "rss_kib" in line]
    final = next(line for line in lines if line.get("final"))
    peak = max(line.get("hwm_kib", 0) for line in lines) / 1024
    maxrss = final["ru_maxrss_kib"] / 1024
    warm = next((rss for processed, rss in samples if processed >= n // 10), samples[0][1])
    last = samples[-1][1]
    section.rows.append(Row("peak RSS while processing (VmHWM)", [peak], "MiB"))
    section.rows.append(Row("peak RSS of the process (ru_maxrss, at exit)", [maxrss], "MiB"))
    section.rows.append(Row("RSS before the first message", [samples[0][1]], "MiB"))
    section.rows.append(Row(f"RSS after {n // 10:,} messages (warm)", [warm], "MiB"))
    section.rows.append(Row(f"RSS after {samples[-1][0]:,} messages", [last], "MiB"))
    section.rows.append(Row("throughput", [final["processed"] / final["s"]], "msgs/s"))
    section.extra["samples"] = samples
    section.extra["growth"] = f"{last - warm:+.1f} MiB from 10% to the end"
    progress(
        f"memory: {final['processed']:,} messages, peak RSS {peak:.1f} MiB "
        f"({time.perf_counter() - started:.1f} s)"
    )
    return section


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="worker subprocess of the memory benchmark")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=20_000)
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args(argv)
    if not args.database:
        parser.error("set MQDEDUP_TEST_DATABASE_URL or --database")
    return worker(args.database, args.messages, args.every)


if __name__ == "__main__":
    sys.exit(main())
