"""Consumer throughput, Kafka -> PostgreSQL and RabbitMQ -> PostgreSQL, side by side.

Reuses the measurements of ``bench/kafka_bench.py`` and ``bench/rabbitmq_bench.py``
(raw loops and mqdedup variants) and adds the consumer a team would write by hand
without mqdedup: per message, ``SELECT`` the id in its own "seen" table, then
``INSERT`` the id and the business row, one transaction per message (raw psycopg, so
the baseline is not slowed by an ORM), broker settled after the commit; and its batch
variant, as safe as mqdedup's bulk path: each batch of 500 claimed and written set-based
(``unnest``) in one transaction, then one offset commit (Kafka) or one
``basic_ack(multiple=True)`` (RabbitMQ).

mqdedup's one-transaction-per-message rows use ``failure_isolation = "transaction"``:
each message claimed, handled and committed alone, the broker settled once per batch.
The first writes its row like the other mqdedup variants (a SQLAlchemy ``insert()``
through ``ctx.session``); the second sends the hand-written consumer's own INSERT as
driver SQL through ``ctx.session.connection()``, so that row and the hand-written one
differ only by what mqdedup does. ``batch_size=1`` (an ack / offset commit and a fetch
per message) is shown for reference.

Run only the consumer suites, or only some variants::

    python -m bench.suite_consumers --only single,single-sql,hand --slow-messages 5000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any

import kafka
import pika
import psycopg
from sqlalchemy import Column, Integer, MetaData, String, Table, make_url

from bench import kafka_bench as kb
from bench import rabbitmq_bench as rb
from bench.suite_common import QUICK, Row, Section, Settings, Sizes, interleave, progress
from mqdedup import create_engine, init_schema
from mqdedup.db.schema import schema

RAW = "raw loop, no DB (ceiling)"
BULK = "mqdedup batch 500, bulk handle_batch"
HANDLE = "mqdedup batch 500, per-message handle"
SINGLE = "mqdedup 1 tx/msg (failure_isolation='transaction')"
SINGLE_SQL = "mqdedup 1 tx/msg, handler writes with driver SQL"
HAND = "hand-written SELECT then INSERT, 1 tx/msg"
HAND_BATCH = "hand-written batch 500, claim + business set-based, 1 tx/batch"
BATCH1 = "mqdedup batch_size=1 (settle per message)"
ORDER = (RAW, HAND_BATCH, BULK, HANDLE, SINGLE, SINGLE_SQL, HAND, BATCH1)
#: The variants that run one transaction per message (they read the smaller count).
PER_MESSAGE = (SINGLE, SINGLE_SQL, HAND, BATCH1)
#: RabbitMQ transaction mode: acks once per batch, two batches in flight.
TX_BATCH = 100


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

    def process_batch(self, message_ids: list[str], orders: list[str], amounts: list[int]) -> int:
        """One transaction for a whole batch, set-based: claim every id at once (the
        ``seen`` insert skips ids already there), then write the orders of the ids just
        claimed; returns how many were new. Repeats inside the batch are kept to the first.
        """
        first: dict[str, int] = {}
        for index, message_id in enumerate(message_ids):
            first.setdefault(message_id, index)
        with self.connection.transaction(), self.connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {self.seen} (message_id) SELECT unnest(%s::text[]) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (list(first),),
            )
            claimed = [first[row[0]] for row in cursor.fetchall()]
            cursor.execute(
                f"INSERT INTO {self.orders} (message_id, order_id, amount) "
                "SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[])",
                (
                    [message_ids[i] for i in claimed],
                    [orders[i] for i in claimed],
                    [amounts[i] for i in claimed],
                ),
            )
            return len(claimed)

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


def handwritten_kafka_batch(hand: HandWritten, bootstrap: str, topic: str, count: int) -> float:
    """kafka-python poll loop, each poll (up to 500) claimed and written set-based in one
    transaction, then its offsets committed: as safe as mqdedup's bulk path."""
    hand.reset()
    consumer = kafka.KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bench-hand-batch-{uuid.uuid4().hex[:8]}",
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
                raise RuntimeError(f"hand-written Kafka batch loop: {done} of {count} in 600 s")
            ids: list[str] = []
            orders: list[str] = []
            amounts: list[int] = []
            for records in consumer.poll(timeout_ms=500, max_records=500).values():
                if first is None:
                    first = time.perf_counter()
                for record in records:
                    payload = json.loads(record.value)
                    ids.append(dict(record.headers)["message-id"].decode())
                    orders.append(payload["order"])
                    amounts.append(payload["amount"])
            if ids:
                hand.process_batch(ids, orders, amounts)
                done += len(ids)
                consumer.commit()
        assert first is not None
        rate = done / (time.perf_counter() - first)
    finally:
        consumer.close()
    if hand.rows() < count:
        raise RuntimeError(f"hand-written Kafka batch loop wrote {hand.rows()} rows, not {count}")
    return rate


def _interleave(
    runs: int,
    variants: dict[str, Callable[[], float]],
    label: str,
    only: Collection[str] | None,
) -> dict[str, list[float]]:
    chosen = {name: run for name, run in variants.items() if only is None or name in only}
    return interleave(runs, chosen, label)


def kafka_suite(settings: Settings, sizes: Sizes, only: Collection[str] | None = None) -> Section:
    """Kafka -> PostgreSQL: the four (five) consumers over the same topic."""
    n, slow = sizes.consumer_messages, sizes.consumer_slow_messages
    section = Section(
        "kafka",
        "Kafka → PostgreSQL consumer throughput",
        f"{n:,} small JSON messages on a 3-partition topic, each variant with its own "
        f"consumer group reading from the beginning; the per-message-transaction variants "
        f"read the first {slow:,}. mqdedup: claim + one business INSERT per message in "
        "the transaction, offsets committed after the commit (transaction mode: batches "
        "of 500, one offset commit per batch after its 500 commits). The clock runs from "
        "the first record to the last commit (group join excluded). Hand-written batch: "
        "one poll of up to 500, claimed and written set-based in one transaction, then one "
        "offset commit.",
    )
    bootstrap = settings.kafka_bootstrap
    engine = create_engine(settings.database_url)
    hand = HandWritten(psycopg_dsn(settings.database_url))
    topic = f"bench-suite-{uuid.uuid4().hex[:8]}"
    try:
        started = time.perf_counter()
        kb.produce(bootstrap, topic, n)
        progress(f"kafka: produced {n:,} messages in {time.perf_counter() - started:.1f} s")
        values = _interleave(
            sizes.runs,
            {
                RAW: lambda: kb.run_raw(bootstrap, topic, n),
                BULK: lambda: kb.run_mqdedup(kb.Bulk, engine, bootstrap, topic, n),
                HANDLE: lambda: kb.run_mqdedup(kb.PerMessage, engine, bootstrap, topic, n),
                SINGLE: lambda: kb.run_mqdedup(
                    kb.PerMessage, engine, bootstrap, topic, slow, failure_isolation="transaction"
                ),
                SINGLE_SQL: lambda: kb.run_mqdedup(
                    kb.PerMessageDriverSQL,
                    engine,
                    bootstrap,
                    topic,
                    slow,
                    failure_isolation="transaction",
                ),
                HAND_BATCH: lambda: handwritten_kafka_batch(hand, bootstrap, topic, n),
                HAND: lambda: handwritten_kafka(hand, bootstrap, topic, slow),
                BATCH1: lambda: kb.run_mqdedup(
                    kb.PerMessage, engine, bootstrap, topic, slow, batch_size=1
                ),
            },
            "kafka",
            only,
        )
        for name in ORDER:
            if name in values:
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
#: The hand-written batch loop: batches of 500 as mqdedup's batch variants, and two
#: batches of prefetch, as mqdedup's default (its best: 5-11% faster than a prefetch of
#: one batch on a quiet machine, interleaved).
BATCH_SIZE = 500
BATCH_PREFETCH = 2 * BATCH_SIZE


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


def handwritten_rabbitmq_batch(hand: HandWritten, url: str, queue: str, count: int) -> float:
    """pika consume loop, prefetch 1000: each batch of 500 (or what arrived within 50 ms)
    claimed and written set-based in one transaction, then one ``basic_ack(multiple=True)``.
    """
    hand.reset()
    started = time.perf_counter()  # like mqdedup's rows: connecting and closing included
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=BATCH_PREFETCH)
    done = 0
    batch: list[tuple[int, str, str, int]] = []

    def flush() -> None:
        nonlocal done
        if not batch:
            return
        hand.process_batch([b[1] for b in batch], [b[2] for b in batch], [b[3] for b in batch])
        channel.basic_ack(batch[-1][0], multiple=True)
        done += len(batch)
        batch.clear()

    deadline = time.monotonic() + 600
    for method, properties, body in channel.consume(queue, inactivity_timeout=0.05):
        if method is not None:
            payload = json.loads(body)
            batch.append(
                (
                    method.delivery_tag,
                    properties.message_id,
                    str(payload["order"]),
                    payload["amount"],
                )
            )
        if len(batch) >= BATCH_SIZE or (method is None and batch):
            flush()
        if done >= count or time.monotonic() > deadline:
            break
    channel.cancel()
    connection.close()
    elapsed = time.perf_counter() - started
    if hand.rows() < count:
        raise RuntimeError(
            f"hand-written RabbitMQ batch loop wrote {hand.rows()} rows, not {count}"
        )
    return done / elapsed


def rabbitmq_suite(
    settings: Settings, sizes: Sizes, only: Collection[str] | None = None
) -> Section:
    """RabbitMQ -> PostgreSQL: the same variants, one queue each, filled by one fanout."""
    n, slow = sizes.consumer_messages, sizes.consumer_slow_messages
    prefetch = 500
    section = Section(
        "rabbitmq",
        "RabbitMQ → PostgreSQL consumer throughput",
        f"{n:,} small persistent JSON messages per queue (one fanout publish fills every "
        f"variant's queue, not timed); the per-message-transaction variants consume "
        f"{slow:,}. Raw loop (the fastest of `bench/rabbitmq_bench.py`'s): prefetch {prefetch}, "
        f"`multiple=True` acks every {prefetch // 2}; mqdedup batches of {prefetch}: prefetch "
        f"{2 * prefetch} (the default, two batches); "
        f"mqdedup transaction mode: batch {TX_BATCH}, prefetch {2 * TX_BATCH}, one ack per "
        "batch after its commits; batch_size=1: prefetch 1; hand-written: prefetch "
        f"{HAND_PREFETCH}, one ack per message after its commit; hand-written batch: prefetch "
        f"{BATCH_PREFETCH} (its best, as mqdedup's default), batches of up to {BATCH_SIZE} "
        "(what arrived within 50 ms), "
        "one transaction and one `multiple=True` ack each, timed from connect to close like "
        "mqdedup's runs.",
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
        # mqdedup's default prefetch: two batches.
        BULK: rb.Variant(
            "bulk", BULK, 2 * prefetch, prefetch, n, rb.run_mqdedup, rb.BulkBenchConsumer
        ),
        HANDLE: rb.Variant(
            "handle", HANDLE, 2 * prefetch, prefetch, n, rb.run_mqdedup, rb.BenchConsumer
        ),
        SINGLE: rb.Variant(
            "single",
            SINGLE,
            2 * TX_BATCH,
            TX_BATCH,
            slow,
            rb.run_mqdedup,
            rb.BenchConsumer,
            attributes={"failure_isolation": "transaction"},
        ),
        SINGLE_SQL: rb.Variant(
            "single-sql",
            SINGLE_SQL,
            2 * TX_BATCH,
            TX_BATCH,
            slow,
            rb.run_mqdedup,
            rb.DriverSQLBenchConsumer,
            attributes={"failure_isolation": "transaction"},
        ),
        BATCH1: rb.Variant("batch-1", BATCH1, 1, 1, slow, rb.run_mqdedup, rb.BenchConsumer),
    }
    chosen = [name for name in ORDER if only is None or name in only]
    tag = uuid.uuid4().hex[:8]
    exchange = f"mqdedup-suite-{tag}"
    queues = {name: f"mqdedup-suite-{tag}-{index}" for index, name in enumerate(chosen)}
    values: dict[str, list[float]] = {name: [] for name in chosen}
    try:
        for run in range(1, sizes.runs + 1):
            started = time.perf_counter()
            rb.fill_queues(url, exchange, list(queues.values()), n, run)
            progress(
                f"rabbitmq: filled {len(queues)} queues in {time.perf_counter() - started:.1f} s"
            )
            for name in chosen:
                started = time.perf_counter()
                if name == HAND:
                    rate = handwritten_rabbitmq(hand, url, queues[name], slow)
                elif name == HAND_BATCH:
                    rate = handwritten_rabbitmq_batch(hand, url, queues[name], n)
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
        for name in chosen:
            section.rows.append(Row(name, values[name], "msgs/s"))
    finally:
        hand.close()
        rb.delete_queues(url, exchange, list(queues.values()))
        orders.metadata.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()
    return section


# -- stand-alone: only the consumer suites -------------------------------------------------

VARIANT_KEYS = {
    "raw": RAW,
    "bulk": BULK,
    "handle": HANDLE,
    "single": SINGLE,
    "single-sql": SINGLE_SQL,
    "hand": HAND,
    "hand-batch": HAND_BATCH,
    "batch-1": BATCH1,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the Kafka and/or RabbitMQ consumer comparison and print the medians."""
    parser = argparse.ArgumentParser(description="mqdedup consumer throughput vs by hand")
    parser.add_argument("--brokers", default="kafka,rabbitmq", help="kafka,rabbitmq")
    parser.add_argument(
        "--only",
        default=",".join(VARIANT_KEYS),
        help=f"comma-separated variants: {', '.join(VARIANT_KEYS)}",
    )
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--slow-messages", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(VARIANT_KEYS))
    if unknown:
        parser.error(
            f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANT_KEYS)}"
        )
    only = {VARIANT_KEYS[key] for key in args.only.split(",")}
    settings = Settings.from_env()
    messages = max(args.messages, args.slow_messages)
    sizes = dataclasses.replace(
        QUICK, runs=args.runs, consumer_messages=messages, consumer_slow_messages=args.slow_messages
    )
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.ERROR)
    suites = {"kafka": kafka_suite, "rabbitmq": rabbitmq_suite}
    for broker in args.brokers.split(","):
        if broker not in suites:
            parser.error(f"unknown broker {broker!r}; choose kafka or rabbitmq")
        section = suites[broker](settings, sizes, only)
        print(f"\n{section.title} (medians of {args.runs} runs)\n")
        print("| variant | msgs/s (median) | runs |")
        print("|---|---:|---|")
        for row in section.rows:
            runs = ", ".join(f"{value:,.0f}" for value in row.values)
            print(f"| {row.variant} | {row.median:,.0f} | {runs} |")
        medians = {row.variant: row.median for row in section.rows}
        if medians.get(BULK) and medians.get(HAND_BATCH):
            # The #11 goal: bulk handle_batch at least as fast as the hand-written batch loop.
            print(f"\nbulk / hand-written batch loop: {medians[BULK] / medians[HAND_BATCH]:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
