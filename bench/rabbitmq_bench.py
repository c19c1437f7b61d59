"""RabbitMQ consumer throughput, side by side in one run (issue 4).

Every variant consumes the same small persistent messages from its own queue (one
fanout publish fills all queues) on the real RabbitMQ and PostgreSQL:

* raw pika, two loops with manual acks and no DB work: one ``basic.ack`` per message,
  and ``multiple=True`` every prefetch/2 deliveries (keeps the window open: the fastest);
* mqdedup, prefetch = batch = P, bulk ``handle_batch`` (one ``INSERT … SELECT unnest``);
* mqdedup, prefetch = batch = P, per-message ``handle`` (the default savepoint mode);
* mqdedup, prefetch P, batch P/2, bulk: two batches in flight, so the broker streams
  the next batch while the database commits this one;
* per-message transactions: mqdedup with ``failure_isolation = "transaction"``, batch
  P/5, prefetch 2 x batch (one transaction per message, one ack per batch), ``handle``;
* the same with prefetch 1 / batch_size 1 (an ack and a broker round trip per message).

Each mqdedup message: dedup claim + one business INSERT, committed before the ack.
Runs are interleaved (run 1 of every variant, then run 2, ...); medians are reported.

Usage::

    .venv/bin/python bench/rabbitmq_bench.py --messages 100000 --runs 3

URLs come from MQDEDUP_RABBITMQ_URL and MQDEDUP_TEST_DATABASE_URL (or the flags).
The per-message-transaction variant consumes ``--slow-messages`` (default: min(messages,
20000)) of its copies: its rate does not depend on the count, only its wall time does.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pika
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, insert, select, text

from mqdedup import Message, create_engine, init_schema
from mqdedup.consumers.context import BatchContext, Context
from mqdedup.db.schema import schema
from mqdedup.rabbitmq import RabbitMQConsumer
from mqdedup.stopping import StopToken

GOAL_RAW_SHARE = 0.60
GOAL_PER_MESSAGE_FACTOR = 5.0


# -- the consumers ---------------------------------------------------------------------------


class BenchConsumer(RabbitMQConsumer):
    """Claim + one business INSERT per message; stops itself after ``target`` commits."""

    orders: ClassVar[Table]
    poll_timeout = 1.0
    target: ClassVar[int] = 0

    def __init__(self, stop: StopToken) -> None:
        self.stop = stop
        self.committed = 0

    def after_commit(self, messages: Sequence[Message]) -> None:
        self.committed += len(messages)
        if self.committed >= self.target:
            self.stop.request()

    def handle(self, message: Message, ctx: Context) -> Any:
        payload = message.json()
        ctx.session.execute(
            insert(self.orders),
            {"message_id": message.id, "order_no": payload["order"], "amount": payload["amount"]},
        )
        return None


class DriverSQLBenchConsumer(BenchConsumer):
    """``handle`` writing its row with driver SQL through the transaction's connection
    (the statement the hand-written consumer sends with psycopg)."""

    def handle(self, message: Message, ctx: Context) -> Any:
        payload = message.json()
        ctx.session.connection().exec_driver_sql(
            f"INSERT INTO {self.orders.name} (message_id, order_no, amount) VALUES (%s, %s, %s)",
            (message.id, payload["order"], payload["amount"]),
        )
        return None


class BulkBenchConsumer(BenchConsumer):
    """One set-based INSERT per batch (``unnest`` of arrays: one round trip, no per-row work)."""

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> None:
        ids, numbers, amounts = [], [], []
        for message in messages:
            payload = message.json()
            ids.append(message.id)
            numbers.append(payload["order"])
            amounts.append(payload["amount"])
        ctx.session.execute(
            text(
                f"INSERT INTO {self.orders.name} (message_id, order_no, amount) "
                "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:numbers AS int[]), "
                "CAST(:amounts AS int[]))"
            ),
            {"ids": ids, "numbers": numbers, "amounts": amounts},
        )


# -- variants ------------------------------------------------------------------------------


@dataclass
class Variant:
    key: str
    label: str
    prefetch: int
    batch: int
    messages: int
    run: Callable[[Variant, Bench, str], float]  # returns msgs/s
    base: type[BenchConsumer] | None = None
    rates: list[float] = field(default_factory=list)
    #: More class attributes of the consumer (e.g. ``failure_isolation``).
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bench:
    rabbit_url: str
    engine: Engine
    prefix: str
    orders: Table
    messages: int


def run_raw(variant: Variant, bench: Bench, queue: str) -> float:
    """A plain pika consume loop, manual acks, no database."""
    connection = pika.BlockingConnection(pika.URLParameters(bench.rabbit_url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=variant.prefetch)
    ack_every = variant.batch  # 1: one basic.ack per message; n: multiple=True every n
    state = {"seen": 0, "pending": 0}
    target = variant.messages

    def on_message(ch: Any, method: Any, _properties: Any, _body: bytes) -> None:
        state["seen"] += 1
        state["pending"] += 1
        if state["pending"] >= ack_every or state["seen"] >= target:
            ch.basic_ack(method.delivery_tag, multiple=ack_every > 1)
            state["pending"] = 0
        if state["seen"] >= target:
            ch.stop_consuming()

    started = time.perf_counter()
    channel.basic_consume(queue, on_message)
    channel.start_consuming()
    elapsed = time.perf_counter() - started
    connection.close()
    if state["seen"] != target:
        raise RuntimeError(f"raw loop saw {state['seen']} of {target}")
    return target / elapsed


def run_mqdedup(variant: Variant, bench: Bench, queue: str) -> float:
    assert variant.base is not None
    stop = StopToken()
    consumer_class = type(
        f"{variant.base.__name__}_{variant.key}",
        (variant.base,),
        {
            "queue": queue,
            "url": bench.rabbit_url,
            "table_prefix": bench.prefix,
            "orders": bench.orders,
            "batch_size": variant.batch,
            "prefetch": variant.prefetch,
            "target": variant.messages,
            **variant.attributes,
        },
    )
    consumer = consumer_class(stop)
    started = time.perf_counter()
    metrics = consumer.run(bench.engine, stop=stop)
    elapsed = time.perf_counter() - started
    rows = count_rows(bench)
    if metrics.processed < variant.messages or rows != metrics.processed:
        raise RuntimeError(
            f"{variant.key}: processed {metrics.processed}, rows {rows}, wanted {variant.messages}"
        )
    return float(metrics.processed) / elapsed


def count_rows(bench: Bench) -> int:
    with bench.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(bench.orders)).scalar_one())


def reset_tables(bench: Bench) -> None:
    processed = schema(bench.prefix).processed
    with bench.engine.begin() as connection:
        connection.execute(text(f"TRUNCATE {bench.orders.name}, {processed.name}"))


# -- broker setup --------------------------------------------------------------------------


def fill_queues(url: str, exchange: str, queues: Sequence[str], count: int, run: int) -> None:
    """Publish ``count`` messages once to a fanout exchange bound to every queue."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.exchange_declare(exchange, exchange_type="fanout", durable=False, auto_delete=False)
    for queue in queues:
        channel.queue_declare(queue, durable=True)
        channel.queue_bind(queue, exchange)
    for number in range(count):
        channel.basic_publish(
            exchange,
            "",
            b'{"order": %d, "amount": 5}' % number,
            pika.BasicProperties(message_id=f"r{run}-{number}", delivery_mode=2),
        )
    deadline = time.monotonic() + 300
    for queue in queues:
        while channel.queue_declare(queue, passive=True).method.message_count < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"queue {queue} never filled")
            time.sleep(0.1)
    connection.close()


def delete_queues(url: str, exchange: str, queues: Sequence[str]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    for queue in queues:
        channel.queue_delete(queue)
        channel.queue_delete(f"{queue}.dlq")
    channel.exchange_delete(exchange)
    connection.close()


# -- main ----------------------------------------------------------------------------------


def verdict(value: float, goal: float = GOAL_RAW_SHARE) -> str:
    return "met" if value >= goal else "NOT met"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--slow-messages", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=500)
    parser.add_argument(
        "--only", default="", help="comma-separated mqdedup variants (bulk,handle,bulk-half)"
    )
    parser.add_argument("--rabbitmq-url", default=os.environ.get("MQDEDUP_RABBITMQ_URL"))
    parser.add_argument(
        "--database-url",
        default=os.environ.get("MQDEDUP_TEST_DATABASE_URL")
        or os.environ.get("MQDEDUP_DATABASE_URL"),
    )
    args = parser.parse_args(argv)
    if not args.rabbitmq_url or not args.database_url:
        parser.error("set MQDEDUP_RABBITMQ_URL and MQDEDUP_TEST_DATABASE_URL (or the flags)")
    if not args.database_url.startswith("postgresql"):
        parser.error("the benchmark needs PostgreSQL")
    logging.basicConfig(level=logging.WARNING)
    slow = args.slow_messages or min(args.messages, 20_000)
    prefetch = args.prefetch

    engine = create_engine(args.database_url)
    prefix = f"bench_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    orders = Table(
        f"{prefix}orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("order_no", Integer, nullable=False),
        Column("amount", Integer, nullable=False),
    )
    orders.metadata.create_all(engine)
    bench = Bench(args.rabbitmq_url, engine, prefix, orders, args.messages)
    n = args.messages
    half = max(1, prefetch // 2)
    variants = [
        Variant("raw-each", "raw pika loop, one ack per message, no DB", prefetch, 1, n, run_raw),
        Variant(
            "raw-multi",
            "raw pika loop, multiple=True ack every P/2, no DB",
            prefetch,
            half,
            n,
            run_raw,
        ),
        Variant(
            "bulk",
            "mqdedup, bulk handle_batch",
            prefetch,
            prefetch,
            n,
            run_mqdedup,
            BulkBenchConsumer,
        ),
        Variant(
            "handle",
            "mqdedup, per-message handle",
            prefetch,
            prefetch,
            n,
            run_mqdedup,
            BenchConsumer,
        ),
        Variant(
            "bulk-half",
            "mqdedup, bulk handle_batch, 2 batches in flight",
            prefetch,
            half,
            n,
            run_mqdedup,
            BulkBenchConsumer,
        ),
        Variant(
            "per-message",
            "per-message transactions (mqdedup, failure_isolation='transaction', handle)",
            2 * max(1, prefetch // 5),
            max(1, prefetch // 5),
            slow,
            run_mqdedup,
            BenchConsumer,
            attributes={"failure_isolation": "transaction"},
        ),
        Variant(
            "batch-1",
            "per-message transactions (mqdedup, batch_size=1, prefetch 1, handle)",
            1,
            1,
            slow,
            run_mqdedup,
            BenchConsumer,
        ),
    ]
    if args.only:
        keep = set(args.only.split(",")) | {"raw-each", "raw-multi", "per-message"}
        variants = [v for v in variants if v.key in keep]
    tag = uuid.uuid4().hex[:8]
    exchange = f"mqdedup-bench-{tag}"
    queues = {v.key: f"mqdedup-bench-{tag}-{v.key}" for v in variants}
    print(
        f"# RabbitMQ consumer benchmark: {n} messages (per-message transactions: {slow}), "
        f"{args.runs} runs, prefetch {prefetch}",
        file=sys.stderr,
    )
    try:
        for run in range(1, args.runs + 1):
            fill_queues(args.rabbitmq_url, exchange, list(queues.values()), n, run)
            for variant in variants:
                reset_tables(bench)
                rate = variant.run(variant, bench, queues[variant.key])
                variant.rates.append(rate)
                print(f"run {run} {variant.key:12s} {rate:9.0f} msgs/s", file=sys.stderr)
            # Leftovers (the per-message variant reads only part of its copies).
            connection = pika.BlockingConnection(pika.URLParameters(args.rabbitmq_url))
            channel = connection.channel()
            for queue in queues.values():
                channel.queue_purge(queue)
            connection.close()
    finally:
        delete_queues(args.rabbitmq_url, exchange, list(queues.values()))
        orders.metadata.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()

    medians = {v.key: statistics.median(v.rates) for v in variants}
    raw_each, raw_multi = medians["raw-each"], medians["raw-multi"]
    per_message = medians["per-message"]
    print()
    print(
        f"RabbitMQ -> PostgreSQL (claim + 1 INSERT per message), {n} messages, "
        f"median of {args.runs} runs, prefetch {prefetch}"
    )
    print()
    print(
        "| variant | prefetch | batch / ack every | messages | msgs/s (median) | runs "
        "| vs raw (ack each) | vs raw (multiple) | vs per-message tx |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for v in variants:
        runs = ", ".join(f"{rate:.0f}" for rate in v.rates)
        print(
            f"| {v.label} | {v.prefetch} | {v.batch} | {v.messages} | {medians[v.key]:,.0f} "
            f"| {runs} | {medians[v.key] / raw_each:.0%} | {medians[v.key] / raw_multi:.0%} "
            f"| {medians[v.key] / per_message:.1f}x |"
        )
    print()
    for key in ("bulk", "handle", "bulk-half"):
        if key not in medians:
            continue
        share_each, share_multi = medians[key] / raw_each, medians[key] / raw_multi
        factor = medians[key] / per_message
        print(
            f"- {key}: {share_each:.0%} of the raw loop acking each message, "
            f"{share_multi:.0%} of the raw loop with multiple acks "
            f"(goal >= {GOAL_RAW_SHARE:.0%}: {verdict(share_each)} / {verdict(share_multi)}); "
            f"{factor:.1f}x per-message transactions (goal >= {GOAL_PER_MESSAGE_FACTOR:.0f}x: "
            f"{verdict(factor, GOAL_PER_MESSAGE_FACTOR)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
