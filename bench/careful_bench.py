"""What careful mode costs: first deliveries vs redelivered ones (in-memory broker -> PostgreSQL).

    python -m bench.careful_bench [--messages 2000] [--runs 3] [--database URL]

A redelivered message (after a crash) that is new runs in careful mode: its attempt is
committed before its handler runs, one message per transaction. Redelivered duplicates
(the usual case after a crash between commit and settle) cost one read per batch.
Prints the median msgs/s of each case, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert

from mqdedup import Consumer, Context, InMemoryBroker, Message, run_until_idle
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema


def one_run(
    engine: Engine, messages: int, *, redelivered: bool, duplicates: bool, isolation: str
) -> float:
    prefix = f"bench_{uuid.uuid4().hex[:6]}_"
    init_schema(engine, prefix)
    orders = Table(
        f"{prefix}orders",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("message_id", String(64)),
    )
    orders.create(engine)

    class Orders(Consumer):
        name = "bench"
        table_prefix = prefix
        batch_size = 500
        poll_timeout = 0.01
        failure_isolation = isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id))

    broker = InMemoryBroker()

    def publish_all() -> None:
        for number in range(messages):
            broker.publish("q", json.dumps({"n": number}), message_id=f"m{number}")

    publish_all()
    if duplicates:  # processed once already: the redelivered copies are duplicates
        run_until_idle(Orders(), broker.transport("q"), engine)
        publish_all()
    if redelivered:  # handed out, then the worker "crashed": all come back redelivered
        transport = broker.transport("q")
        transport.fetch(messages, 1)
        transport.crash()
    started = time.perf_counter()
    run_until_idle(Orders(), broker.transport("q"), engine)
    took = time.perf_counter() - started
    orders.drop(engine)
    schema(prefix).metadata.drop_all(engine)
    return messages / took


CASES: dict[str, dict[str, Any]] = {
    "first deliveries, batch mode": {
        "redelivered": False,
        "duplicates": False,
        "isolation": "auto",
    },
    "first deliveries, transaction mode": {
        "redelivered": False,
        "duplicates": False,
        "isolation": "transaction",
    },
    "redelivered and new (careful mode)": {
        "redelivered": True,
        "duplicates": False,
        "isolation": "auto",
    },
    "redelivered duplicates": {"redelivered": True, "duplicates": True, "isolation": "auto"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args()
    if not args.database:
        parser.error("--database (or MQDEDUP_TEST_DATABASE_URL) is required")
    engine = create_engine(args.database)
    for label, case in CASES.items():
        rates = [one_run(engine, args.messages, **case) for _ in range(args.runs)]
        median = statistics.median(rates)
        print(f"{label:38} median {median:>9,.0f} msgs/s  {[round(r) for r in rates]}")
    engine.dispose()


if __name__ == "__main__":
    main()
