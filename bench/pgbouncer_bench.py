"""What PgBouncer (transaction mode) and prepared statements cost the worker:
``python -m bench.pgbouncer_bench [--messages N] [--rounds R]``.

The same consumer (one business row per message, in the claim's transaction) over the
in-memory broker, one message per transaction and 100 per transaction, on three
connections to the shared test PostgreSQL: direct with psycopg's prepared statements
(the default), direct without them (``prepare_threshold=None``, what mqdedup does behind
a transaction pooler), and through PgBouncer (``scripts/services.sh start pgbouncer``,
``?pooler=transaction``). Rounds interleave the three; prints messages/s per round and
the median, side by side. Needs ``MQDEDUP_TEST_DATABASE_URL`` and
``MQDEDUP_TEST_PGBOUNCER_URL`` (``eval "$(bash scripts/services.sh env)"``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any, ClassVar

from sqlalchemy import Column, Integer, MetaData, String, Table, insert

from mqdedup import Consumer, Context, InMemoryBroker, Message, run_until_idle
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema


def orders(prefix: str) -> Table:
    return Table(
        f"{prefix}orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
    )


def consumer_class(prefix: str, batch: int) -> type[Consumer]:
    table = orders(prefix)

    class Orders(Consumer):
        name = f"bench-{batch}"
        table_prefix = prefix
        batch_size = batch
        failure_isolation: ClassVar[Any] = "transaction" if batch == 1 else "auto"

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(table).values(message_id=message.id))
            return None

    return Orders


def run(url: str, options: dict[str, Any], prefix: str, batch: int, count: int) -> float:
    engine = create_engine(url, **options)
    try:
        broker = InMemoryBroker()
        for n in range(count):
            broker.publish("orders", b"{}", message_id=f"{uuid.uuid4().hex}-{n}")
        started = time.perf_counter()
        metrics = run_until_idle(
            consumer_class(prefix, batch)(), broker.transport("orders"), engine
        )
        elapsed = time.perf_counter() - started
        assert metrics.processed == count, metrics
        return count / elapsed
    finally:
        engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    direct = os.environ["MQDEDUP_TEST_DATABASE_URL"]
    pooled = os.environ["MQDEDUP_TEST_PGBOUNCER_URL"]
    variants = {
        "direct, prepared (psycopg default)": (direct + "?pooler=none", {}),
        "direct, prepare_threshold=None": (
            direct + "?pooler=none",
            {"connect_args": {"prepare_threshold": None}},
        ),
        "PgBouncer transaction mode": (pooled + "?pooler=transaction", {}),
    }
    prefix = f"pgbb_{uuid.uuid4().hex[:6]}_"
    setup = create_engine(direct)
    init_schema(setup, prefix)
    orders(prefix).metadata.create_all(setup)
    try:
        for batch in (1, 100):
            count = args.messages if batch == 100 else args.messages // 4
            rates: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, (url, options) in variants.items():
                    rates[name].append(run(url, options, prefix, batch, count))
            print(f"\n{count} messages, {batch} per transaction (messages/s, median of rounds)")
            for name, values in rates.items():
                shown = ", ".join(f"{value:,.0f}" for value in values)
                print(f"  {name:40} {statistics.median(values):>8,.0f}   ({shown})")
    finally:
        orders(prefix).metadata.drop_all(setup)
        schema(prefix).metadata.drop_all(setup)
        setup.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
