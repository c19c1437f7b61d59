"""asyncio consumers next to the synchronous ones, in the same run: Kafka and RabbitMQ.

For each broker, four consumers over the same messages, writing the same rows to
PostgreSQL (claim + one business INSERT per message, one transaction per batch of 500):

* synchronous (kafka-python / pika transports, psycopg): a bulk ``handle_batch`` (one
  ``unnest`` INSERT) and a per-message ``handle`` (one SQLAlchemy ``insert()`` each);
* asyncio (``AsyncKafkaConsumer`` / ``AsyncRabbitMQConsumer``: the same kafka-python /
  pika transports driven from the event loop, ``async def`` handlers awaiting the
  ``AsyncSession`` on psycopg's async driver, one event loop): the same two handlers.

The synchronous rows are ``bench/kafka_bench.py``'s and ``bench/rabbitmq_bench.py``'s
consumers, measured the same way (Kafka: first record to the last commit; RabbitMQ:
start to the last commit). Run alone::

    python -m bench.suite_async --quick
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import kafka
import pika
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, text

from bench import kafka_bench as kb
from bench import rabbitmq_bench as rb
from bench.suite_common import FULL, QUICK, Row, Section, Settings, Sizes, interleave, progress
from mqdedup import AsyncContext, Message, create_engine, init_schema
from mqdedup.consumers.context import AsyncBatchContext
from mqdedup.db.schema import schema
from mqdedup.kafka import AsyncKafkaConsumer
from mqdedup.rabbitmq import AsyncRabbitMQConsumer
from mqdedup.stopping import StopToken

SYNC_BULK = "sync, bulk handle_batch"
ASYNC_BULK = "asyncio, bulk handle_batch"
SYNC_HANDLE = "sync, per-message handle"
ASYNC_HANDLE = "asyncio, per-message handle"
ORDER = (SYNC_BULK, ASYNC_BULK, SYNC_HANDLE, ASYNC_HANDLE)
BATCH = 500


# -- Kafka ---------------------------------------------------------------------------------


class AsyncKafkaPerMessage(AsyncKafkaConsumer):
    """``kafka_bench.PerMessage`` with ``async def handle``."""

    batch_size = BATCH
    poll_timeout = 0.5
    metrics_interval = 3600.0
    table: ClassVar[Table]
    clock: ClassVar[Any]

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        self.clock.start()
        payload = message.json()
        await ctx.session.execute(
            insert(self.table),
            {"message_id": message.id, "order_id": payload["order"], "amount": payload["amount"]},
        )

    async def after_commit(self, messages: Sequence[Message]) -> None:
        self.clock.committed(len(messages))


class AsyncKafkaBulk(AsyncKafkaPerMessage):
    """``kafka_bench.Bulk`` (one ``unnest`` INSERT per batch), awaited."""

    async def handle_batch(
        self, messages: Sequence[Message], ctx: AsyncBatchContext
    ) -> Mapping[str, Any]:
        self.clock.start()
        ids, orders, amounts = [], [], []
        for message in messages:
            payload = message.json()
            ids.append(message.id)
            orders.append(payload["order"])
            amounts.append(payload["amount"])
        await ctx.session.execute(
            text(
                f"INSERT INTO {self.table.name} (message_id, order_id, amount) "
                "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:orders AS text[]), "
                "CAST(:amounts AS integer[]))"
            ),
            {"ids": ids, "orders": orders, "amounts": amounts},
        )
        return {}


def kafka_rows(settings: Settings, sizes: Sizes) -> dict[str, list[float]]:
    """The four consumers over one 3-partition topic, each with its own group."""
    n, bootstrap = sizes.consumer_messages, settings.kafka_bootstrap
    engine = create_engine(settings.database_url)
    topic = f"bench-async-{uuid.uuid4().hex[:8]}"
    try:
        kb.produce(bootstrap, topic, n)
        return interleave(
            sizes.runs,
            {
                SYNC_BULK: lambda: kb.run_mqdedup(kb.Bulk, engine, bootstrap, topic, n),
                ASYNC_BULK: lambda: kb.run_mqdedup(AsyncKafkaBulk, engine, bootstrap, topic, n),
                SYNC_HANDLE: lambda: kb.run_mqdedup(kb.PerMessage, engine, bootstrap, topic, n),
                ASYNC_HANDLE: lambda: kb.run_mqdedup(
                    AsyncKafkaPerMessage,
                    engine,
                    bootstrap,
                    topic,
                    n,
                ),
            },
            "async/kafka",
        )
    finally:
        admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.delete_topics([topic])
        admin.close()
        engine.dispose()


# -- RabbitMQ ------------------------------------------------------------------------------


class AsyncRabbitPerMessage(AsyncRabbitMQConsumer):
    """``rabbitmq_bench.BenchConsumer`` with ``async def handle``."""

    orders: ClassVar[Table]
    poll_timeout = 1.0
    target: ClassVar[int] = 0

    def __init__(self, stop: StopToken) -> None:
        self.stop = stop
        self.committed = 0

    async def after_commit(self, messages: Sequence[Message]) -> None:
        self.committed += len(messages)
        if self.committed >= self.target:
            self.stop.request()

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        payload = message.json()
        await ctx.session.execute(
            insert(self.orders),
            {"message_id": message.id, "order_no": payload["order"], "amount": payload["amount"]},
        )
        return None


class AsyncRabbitBulk(AsyncRabbitPerMessage):
    """``rabbitmq_bench.BulkBenchConsumer`` (one ``unnest`` INSERT per batch), awaited."""

    async def handle_batch(self, messages: Sequence[Message], ctx: AsyncBatchContext) -> None:
        ids, numbers, amounts = [], [], []
        for message in messages:
            payload = message.json()
            ids.append(message.id)
            numbers.append(payload["order"])
            amounts.append(payload["amount"])
        await ctx.session.execute(
            text(
                f"INSERT INTO {self.orders.name} (message_id, order_no, amount) "
                "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:numbers AS int[]), "
                "CAST(:amounts AS int[]))"
            ),
            {"ids": ids, "numbers": numbers, "amounts": amounts},
        )


def rabbitmq_rows(settings: Settings, sizes: Sizes) -> dict[str, list[float]]:
    """The four consumers, one queue each, filled by one fanout publish per run."""
    n, url = sizes.consumer_messages, settings.rabbitmq_url
    engine = create_engine(settings.database_url)
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
    bench = rb.Bench(url, engine, prefix, orders, n)
    bases: dict[str, Any] = {
        SYNC_BULK: rb.BulkBenchConsumer,
        ASYNC_BULK: AsyncRabbitBulk,
        SYNC_HANDLE: rb.BenchConsumer,
        ASYNC_HANDLE: AsyncRabbitPerMessage,
    }
    variants = {
        name: rb.Variant(f"v{index}", name, BATCH, BATCH, n, rb.run_mqdedup, base)
        for index, (name, base) in enumerate(bases.items())
    }
    tag = uuid.uuid4().hex[:8]
    exchange = f"mqdedup-async-{tag}"
    queues = {name: f"mqdedup-async-{tag}-{index}" for index, name in enumerate(ORDER)}
    values: dict[str, list[float]] = {name: [] for name in ORDER}
    try:
        for run in range(1, sizes.runs + 1):
            rb.fill_queues(url, exchange, list(queues.values()), n, run)
            for name in ORDER:
                started = time.perf_counter()
                rb.reset_tables(bench)
                rate = variants[name].run(variants[name], bench, queues[name])
                values[name].append(rate)
                progress(
                    f"async/rabbitmq run {run}: {name}: {rate:,.0f} "
                    f"({time.perf_counter() - started:.1f} s)"
                )
            connection = pika.BlockingConnection(pika.URLParameters(url))
            channel = connection.channel()
            for queue in queues.values():
                channel.queue_purge(queue)
            connection.close()
        return values
    finally:
        rb.delete_queues(url, exchange, list(queues.values()))
        orders.metadata.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()


# -- the suite -----------------------------------------------------------------------------


def async_suite(settings: Settings, sizes: Sizes) -> Section:
    """Sync and asyncio consumers side by side, Kafka then RabbitMQ."""
    n = sizes.consumer_messages
    section = Section(
        "async",
        "asyncio consumers next to synchronous ones (→ PostgreSQL)",
        f"{n:,} small JSON messages per variant, batches of {BATCH} (RabbitMQ: prefetch "
        f"{BATCH}); claim + one business INSERT per message in one transaction per batch. "
        "Both on the kafka-python / pika transports. Synchronous: psycopg. asyncio: the "
        "transports driven from one event loop and `async def` handlers awaiting an "
        "`AsyncSession` (psycopg async); the same Worker and Processor run inside the "
        "greenlet bridge.",
    )
    for broker, measure in (("Kafka", kafka_rows), ("RabbitMQ", rabbitmq_rows)):
        values = measure(settings, sizes)
        for name in ORDER:
            section.rows.append(Row(f"{broker}: {name}", values[name], "msgs/s"))
    return section


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite alone and print the medians."""
    parser = argparse.ArgumentParser(description="mqdedup asyncio vs sync consumers")
    parser.add_argument("--quick", action="store_true", help="one run, 2,000 messages")
    parser.add_argument("--messages", type=int, default=None, help="messages per variant")
    parser.add_argument("--runs", type=int, default=None, help="runs per variant")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.messages is not None:
        sizes = Sizes(**{**sizes.__dict__, "consumer_messages": args.messages})
    if args.runs is not None:
        sizes = Sizes(**{**sizes.__dict__, "runs": args.runs})
    section = async_suite(Settings.from_env(), sizes)
    for row in section.rows:
        print(f"{row.variant:45s} {row.median:>10,.0f} msgs/s  {[round(v) for v in row.values]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
