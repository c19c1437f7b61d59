"""Consumer throughput, Kafka -> PostgreSQL and RabbitMQ -> PostgreSQL, side by side.

Reuses the measurements of ``bench/kafka_bench.py`` and ``bench/rabbitmq_bench.py``
(raw loops and mqdedup variants) and adds the consumer a team would write by hand
without mqdedup: per message, ``SELECT`` the id in its own "seen" table, then
``INSERT`` the id and the business row, one transaction per message (raw psycopg, so
the baseline is not slowed by an ORM), broker settled after the commit.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import kafka
import pika
import psycopg
from sqlalchemy import Column, Integer, MetaData, String, Table, make_url

from bench import kafka_bench as kb
from bench import rabbitmq_bench as rb
from bench.suite_common import Row, Section, Settings, Sizes, interleave, progress
from mqdedup import create_engine, init_schema
from mqdedup.schema import schema

RAW = "raw loop, no DB (ceiling)"
BULK = "mqdedup batch 500, bulk handle_batch"
HANDLE = "mqdedup batch 500, per-message handle"
SINGLE = "mqdedup per-message mode (batch_size=1, 1 tx/msg)"
HAND = "hand-written SELECT then INSERT, 1 tx/msg"
ORDER = (RAW, BULK, HANDLE, SINGLE, HAND)


def psycopg_dsn(database_url: str) -> str:
    """The SQLAlchemy URL as a plain libpq URL for psycopg."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


class HandWritten:
    """The tables and the per-message transaction of the hand-written consumer."""

    def __init__(self, dsn: str) -> None:
        self.prefix = f"bench_hand_{uuid.uuid4().hex[:8]}_"
        self.connection = psycopg.connect(dsn, autocommit=True)
        self.seen = f"{self.prefix}seen"
        self.orders = f"{self.prefix}orders"
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE {self.seen} (message_id text PRIMARY KEY, "
                "processed_at timestamptz NOT NULL DEFAULT now())"
            )
            cursor.execute(
                f"CREATE TABLE {self.orders} (row_id bigserial PRIMARY KEY, "
                "message_id text NOT NULL, order_id text, amount integer)"
            )

    def reset(self) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {self.seen}, {self.orders}")

    def process(self, message_id: str, order: str, amount: int) -> bool:
        """One transaction: skip the message if seen, else record it and write the order."""
        with self.connection.transaction(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {self.seen} WHERE message_id = %s", (message_id,))
            if cursor.fetchone() is not None:
                return False
            cursor.execute(f"INSERT INTO {self.seen} (message_id) VALUES (%s)", (message_id,))
            cursor.execute(
                f"INSERT INTO {self.orders} (message_id, order_id, amount) VALUES (%s, %s, %s)",
                (message_id, order, amount),
            )
            return True

    def rows(self) -> int:
        with self.connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {self.orders}")
            row = cursor.fetchone()
            return int(row[0]) if row else 0

    def close(self) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {self.seen}, {self.orders}")
        self.connection.close()


# -- Kafka ---------------------------------------------------------------------------------


def handwritten_kafka(hand: HandWritten, bootstrap: str, topic: str, count: int) -> float:
    """kafka-python poll loop; offsets committed after each poll's transactions."""
    hand.reset()
    consumer = kafka.KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bench-hand-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=500,
    )
    try:
        done = 0
        first: float | None = None
        deadline = time.monotonic() + 600
        while done < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"hand-written Kafka consumer: {done} of {count} in 600 s")
            for records in consumer.poll(timeout_ms=500).values():
                if first is None:
                    first = time.perf_counter()
                for record in records:
                    if done >= count:
                        break
                    headers = dict(record.headers)
                    payload = json.loads(record.value)
                    hand.process(
                        headers["message-id"].decode(), payload["order"], payload["amount"]
                    )
                    done += 1
            consumer.commit()
        assert first is not None
        rate = done / (time.perf_counter() - first)
    finally:
        consumer.close()
    if hand.rows() != count:
        raise RuntimeError(f"hand-written Kafka consumer wrote {hand.rows()} rows, not {count}")
    return rate


def kafka_suite(settings: Settings, sizes: Sizes) -> Section:
    """Kafka -> PostgreSQL: the four (five) consumers over the same topic."""
    n, slow = sizes.consumer_messages, sizes.consumer_slow_messages
    section = Section(
        "kafka",
        "Kafka → PostgreSQL consumer throughput",
        f"{n:,} small JSON messages on a 3-partition topic, each variant with its own "
        f"consumer group reading from the beginning; the per-message-transaction variants "
        f"read the first {slow:,}. mqdedup: claim + one business INSERT per message in "
        "the transaction, offsets committed after the commit. The clock runs from the "
        "first record to the last commit (group join excluded).",
    )
    bootstrap = settings.kafka_bootstrap
    engine = create_engine(settings.database_url)
    hand = HandWritten(psycopg_dsn(settings.database_url))
    topic = f"bench-suite-{uuid.uuid4().hex[:8]}"
    try:
        started = time.perf_counter()
        kb.produce(bootstrap, topic, n)
        progress(f"kafka: produced {n:,} messages in {time.perf_counter() - started:.1f} s")
        values = interleave(
            sizes.runs,
            {
                RAW: lambda: kb.run_raw(bootstrap, topic, n),
                BULK: lambda: kb.run_mqdedup(kb.Bulk, engine, bootstrap, topic, n),
                HANDLE: lambda: kb.run_mqdedup(kb.PerMessage, engine, bootstrap, topic, n),
                SINGLE: lambda: kb.run_mqdedup(
                    kb.PerMessage, engine, bootstrap, topic, slow, batch_size=1
                ),
                HAND: lambda: handwritten_kafka(hand, bootstrap, topic, slow),
            },
            "kafka",
        )
        for name in ORDER:
            section.rows.append(Row(name, values[name], "msgs/s"))
    finally:
        hand.close()
        admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.delete_topics([topic])
        admin.close()
        engine.dispose()
    return section


# -- RabbitMQ ------------------------------------------------------------------------------

HAND_PREFETCH = 100


def handwritten_rabbitmq(hand: HandWritten, url: str, queue: str, count: int) -> float:
    """pika consume loop, prefetch 100, one transaction then one ack per message."""
    hand.reset()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=HAND_PREFETCH)
    state = {"done": 0}

    def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
        payload = json.loads(body)
        hand.process(properties.message_id, str(payload["order"]), payload["amount"])
        ch.basic_ack(method.delivery_tag)
        state["done"] += 1
        if state["done"] >= count:
            ch.stop_consuming()

    started = time.perf_counter()
    channel.basic_consume(queue, on_message)
    channel.start_consuming()
    elapsed = time.perf_counter() - started
    connection.close()
    if hand.rows() != count:
        raise RuntimeError(f"hand-written RabbitMQ consumer wrote {hand.rows()} rows, not {count}")
    return count / elapsed


def rabbitmq_suite(settings: Settings, sizes: Sizes) -> Section:
    """RabbitMQ -> PostgreSQL: the same variants, one queue each, filled by one fanout."""
    n, slow = sizes.consumer_messages, sizes.consumer_slow_messages
    prefetch = 500
    section = Section(
        "rabbitmq",
        "RabbitMQ → PostgreSQL consumer throughput",
        f"{n:,} small persistent JSON messages per queue (one fanout publish fills every "
        f"variant's queue, not timed); the per-message-transaction variants consume "
        f"{slow:,}. Raw loop (the fastest of `bench/rabbitmq_bench.py`'s): prefetch {prefetch}, "
        f"`multiple=True` acks every {prefetch // 2}; mqdedup batches: prefetch {prefetch}; "
        "mqdedup per-message: prefetch 1; hand-written: prefetch "
        f"{HAND_PREFETCH}, one ack per message after its commit.",
    )
    url = settings.rabbitmq_url
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
    hand = HandWritten(psycopg_dsn(settings.database_url))
    variants = {
        RAW: rb.Variant("raw", RAW, prefetch, prefetch // 2, n, rb.run_raw),
        BULK: rb.Variant("bulk", BULK, prefetch, prefetch, n, rb.run_mqdedup, rb.BulkBenchConsumer),
        HANDLE: rb.Variant(
            "handle", HANDLE, prefetch, prefetch, n, rb.run_mqdedup, rb.BenchConsumer
        ),
        SINGLE: rb.Variant("single", SINGLE, 1, 1, slow, rb.run_mqdedup, rb.BenchConsumer),
    }
    tag = uuid.uuid4().hex[:8]
    exchange = f"mqdedup-suite-{tag}"
    queues = {name: f"mqdedup-suite-{tag}-{index}" for index, name in enumerate(ORDER)}
    values: dict[str, list[float]] = {name: [] for name in ORDER}
    try:
        for run in range(1, sizes.runs + 1):
            started = time.perf_counter()
            rb.fill_queues(url, exchange, list(queues.values()), n, run)
            progress(
                f"rabbitmq: filled {len(queues)} queues in {time.perf_counter() - started:.1f} s"
            )
            for name in ORDER:
                started = time.perf_counter()
                if name == HAND:
                    rate = handwritten_rabbitmq(hand, url, queues[name], slow)
                else:
                    rb.reset_tables(bench)
                    variant = variants[name]
                    rate = variant.run(variant, bench, queues[name])
                values[name].append(rate)
                progress(
                    f"rabbitmq run {run}: {name}: {rate:,.0f} "
                    f"({time.perf_counter() - started:.1f} s)"
                )
            connection = pika.BlockingConnection(pika.URLParameters(url))
            channel = connection.channel()
            for queue in queues.values():
                channel.queue_purge(queue)
            connection.close()
        for name in ORDER:
            section.rows.append(Row(name, values[name], "msgs/s"))
    finally:
        hand.close()
        rb.delete_queues(url, exchange, list(queues.values()))
        orders.metadata.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()
    return section
