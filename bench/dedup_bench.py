"""Cost of dedup on PostgreSQL, side by side in one run (issue: foundation).

Messages come from the in-memory broker so that only database work is measured. Modes:

* batch of 500, bulk handler (one INSERT per batch), with and without the claim;
* batch of 500, per-message handler (``failure_isolation = "auto"``, the default: no
  savepoints unless a handler fails), with and without the claim;
* batch of 500, per-message handler, ``failure_isolation = "savepoint"``;
* one transaction per message (batch_size = 1), per-message handler.

Usage: .venv/bin/python bench/dedup_bench.py [--messages 20000] [--runs 3] [--database URL]
Prints a Markdown table of medians (msgs/s) and the issue's goals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Engine, insert

from mqdedup import Consumer, InMemoryBroker, Message, create_engine, run_until_idle
from mqdedup.consumers.context import BatchContext, Context
from mqdedup.db.schema import schema
from tests.support import business, orders


class PerMessage(Consumer):
    name = "bench"
    batch_size = 500
    poll_timeout = 0.0

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(
            insert(orders), {"message_id": message.id, "order_id": "o", "amount": 1}
        )


class Bulk(PerMessage):
    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> None:
        ctx.session.execute(
            insert(orders), [{"message_id": m.id, "order_id": "o", "amount": 1} for m in messages]
        )


def variant(base: type[Consumer], **attributes: Any) -> type[Consumer]:
    return type(base.__name__, (base,), attributes)


MODES: dict[str, type[Consumer]] = {
    "batch 500, bulk handler, dedup": Bulk,
    "batch 500, bulk handler, no dedup": variant(Bulk, deduplicate=False),
    "batch 500, per-message handler, dedup": PerMessage,
    "batch 500, per-message handler, no dedup": variant(PerMessage, deduplicate=False),
    "batch 500, per-message handler in savepoints, dedup": variant(
        PerMessage, failure_isolation="savepoint"
    ),
    "per-message transactions (batch 1), dedup": variant(PerMessage, batch_size=1),
}


def reset(engine: Engine) -> None:
    business.drop_all(engine)
    schema().metadata.drop_all(engine)
    schema().metadata.create_all(engine)
    business.create_all(engine)


def one_run(engine: Engine, consumer_class: type[Consumer], messages: int) -> float:
    reset(engine)
    broker = InMemoryBroker(seed=1)
    for number in range(messages):
        broker.publish("bench", json.dumps({"n": number}), message_id=f"m-{number:08d}")
    started = time.perf_counter()
    metrics = run_until_idle(consumer_class(), broker.transport("bench"), engine)
    elapsed = time.perf_counter() - started
    assert metrics.processed == messages, metrics
    return messages / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--database",
        default=os.environ.get(
            "MQDEDUP_TEST_DATABASE_URL",
            "postgresql+psycopg://mqdedup:mqdedup@127.0.0.1:5432/mqdedup",
        ),
    )
    args = parser.parse_args()
    engine = create_engine(args.database)
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.runs):  # interleave modes so drift hits all of them alike
        for mode, consumer_class in MODES.items():
            count = args.messages if "batch 1" not in mode else max(2_000, args.messages // 5)
            results[mode].append(one_run(engine, consumer_class, count))
    medians = {mode: statistics.median(values) for mode, values in results.items()}

    print(f"\nPostgreSQL dedup benchmark: {args.messages} messages, median of {args.runs} runs\n")
    print("| mode | msgs/s (median) | runs |")
    print("|---|---:|---|")
    for mode, value in medians.items():
        runs = ", ".join(f"{v:,.0f}" for v in results[mode])
        print(f"| {mode} | {value:,.0f} | {runs} |")
    single = medians["per-message transactions (batch 1), dedup"]
    for kind in ("bulk handler", "per-message handler"):
        with_dedup = medians[f"batch 500, {kind}, dedup"]
        without = medians[f"batch 500, {kind}, no dedup"]
        cost = (1 - with_dedup / without) * 100
        print(
            f"\n{kind}: dedup costs {cost:.1f}% (goal <= 15%); "
            f"batch is {with_dedup / single:.1f}x per-message transactions (goal >= 5x)"
        )
    savepoints = medians["batch 500, per-message handler in savepoints, dedup"]
    print(f"per-message handler in savepoints: {savepoints / single:.1f}x per-message transactions")
    engine.dispose()


if __name__ == "__main__":
    main()
