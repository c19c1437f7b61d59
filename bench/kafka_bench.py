"""Kafka consumer throughput, side by side in one run (issue 3).

Every variant reads the same topic (small JSON messages with a ``message-id`` header, 3
partitions) from the beginning with its own consumer group, on the real Kafka broker
and PostgreSQL:

* raw kafka-python: a ``poll()`` loop that decodes nothing and does no database work;
* mqdedup, batch of 500, bulk ``handle_batch`` (one INSERT per batch);
* mqdedup, batch of 500, per-message ``handle`` (one INSERT per message);
* per-message transactions: mqdedup with ``failure_isolation = "transaction"`` (one
  transaction per message, offsets committed once per batch of 500), ``handle``;
* the same with ``batch_size = 1`` (an offset commit and a poll per message: slow).

Each mqdedup message: dedup claim + one business INSERT in one transaction, committed
before its offset. The clock runs from the first record handed out to the last one
committed (the consumer group join is not measured). Runs are interleaved (run 1 of
every variant, then run 2, ...); medians are reported. The per-message-transaction
variant reads only the first ``--slow-messages`` messages (it is ~1,000 msgs/s).

Usage::

    .venv/bin/python bench/kafka_bench.py --messages 100000 --runs 3

Needs ``MQDEDUP_KAFKA_BOOTSTRAP`` and ``MQDEDUP_TEST_DATABASE_URL`` (or the flags).
Prints a Markdown table (msgs/s, medians) and the issue's goals.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kafka
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert, text

from mqdedup import StopToken, create_engine, init_schema
from mqdedup.consumers.context import BatchContext, Context
from mqdedup.db.schema import schema
from mqdedup.kafka import KafkaConsumer
from mqdedup.message import Message

PARTITIONS = 3


def business_table(prefix: str) -> Table:
    return Table(
        f"{prefix}orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("order_id", String(64)),
        Column("amount", Integer),
    )


class _Clock:
    """First record handed out -> the ``target``-th message committed."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.done = threading.Event()

    def start(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def committed(self, count: int) -> None:
        self.count += count
        if self.count >= self.target and not self.done.is_set():
            self.last = time.perf_counter()
            self.done.set()

    @property
    def rate(self) -> float:
        assert self.first is not None and self.last is not None
        return self.count / (self.last - self.first)


class PerMessage(KafkaConsumer):
    batch_size = 500
    poll_timeout = 0.5
    metrics_interval = 3600.0
    table: ClassVar[Table]
    clock: ClassVar[_Clock]

    def handle(self, message: Message, ctx: Context) -> Any:
        self.clock.start()
        payload = message.json()
        ctx.session.execute(
            insert(self.table),
            {"message_id": message.id, "order_id": payload["order"], "amount": payload["amount"]},
        )

    def after_commit(self, messages: Sequence[Message]) -> None:
        self.clock.committed(len(messages))


class PerMessageDriverSQL(PerMessage):
    """``handle`` writing its row with driver SQL through the transaction's connection:
    the same statement the hand-written consumer sends with psycopg (no SQLAlchemy
    statement to build and compile per message)."""

    def handle(self, message: Message, ctx: Context) -> Any:
        self.clock.start()
        payload = message.json()
        ctx.session.connection().exec_driver_sql(
            f"INSERT INTO {self.table.name} (message_id, order_id, amount) VALUES (%s, %s, %s)",
            (message.id, payload["order"], payload["amount"]),
        )


class Bulk(PerMessage):
    """One set-based INSERT per batch (``unnest`` of three arrays), the recommended
    shape of a bulk handler on PostgreSQL (see docs/kafka.md)."""

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> Mapping[str, Any]:
        self.clock.start()
        ids, orders, amounts = [], [], []
        for message in messages:
            payload = message.json()
            ids.append(message.id)
            orders.append(payload["order"])
            amounts.append(payload["amount"])
        ctx.session.execute(
            text(
                f"INSERT INTO {self.table.name} (message_id, order_id, amount) "
                "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:orders AS text[]), "
                "CAST(:amounts AS integer[]))"
            ),
            {"ids": ids, "orders": orders, "amounts": amounts},
        )
        return {}


def produce(bootstrap: str, topic: str, count: int) -> None:
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics({topic: {"num_partitions": PARTITIONS}}, wait_for_metadata=True)
    admin.close()
    producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks=1)
    for i in range(count):
        body = f'{{"order": "o-{i}", "amount": {i % 1000}}}'.encode()
        producer.send(topic, value=body, headers=[("message-id", f"msg-{i}".encode())])
    producer.flush(timeout=120)
    producer.close()


def run_raw(bootstrap: str, topic: str, count: int) -> float:
    consumer = kafka.KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bench-raw-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=500,
    )
    try:
        seen = 0
        first: float | None = None
        deadline = time.monotonic() + 300
        while seen < count and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                if first is None:
                    first = time.perf_counter()
                seen += len(records)
        consumer.commit()
        assert first is not None, "no records"
        return seen / (time.perf_counter() - first)
    finally:
        consumer.close()


def run_mqdedup(
    base: type[PerMessage],
    engine: Engine,
    bootstrap: str,
    topic: str,
    count: int,
    **attributes: Any,
) -> float:
    prefix = f"bench_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    table = business_table(prefix)
    table.create(engine)
    clock = _Clock(count)
    consumer_class = type(
        base.__name__,
        (base,),
        {
            "topics": [topic],
            "group_id": f"bench-{uuid.uuid4().hex[:8]}",
            "bootstrap_servers": bootstrap,
            "table_prefix": prefix,
            "table": table,
            "clock": clock,
            **attributes,
        },
    )
    stop = StopToken()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer_class().run(engine, stop=stop)
        except BaseException as error:
            errors.append(error)
            clock.done.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        if not clock.done.wait(600):
            raise RuntimeError(f"{base.__name__}: only {clock.count} of {count} in 600 s")
        if errors:
            raise errors[0]
        return clock.rate
    finally:
        stop.request()
        thread.join(60)
        table.drop(engine)
        schema(prefix).metadata.drop_all(engine)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--slow-messages", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bootstrap", default=os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP"))
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args(argv)
    if not args.bootstrap or not args.database:
        parser.error("set MQDEDUP_KAFKA_BOOTSTRAP and MQDEDUP_TEST_DATABASE_URL (or the flags)")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.ERROR)

    engine = create_engine(args.database)
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    count, slow = args.messages, min(args.slow_messages, args.messages)
    started = time.perf_counter()
    produce(args.bootstrap, topic, count)
    print(f"produced {count} messages to {topic} in {time.perf_counter() - started:.1f} s")

    variants: dict[str, tuple[int, Callable[[], float]]] = {
        "raw kafka-python poll loop, no DB": (
            count,
            lambda: run_raw(args.bootstrap, topic, count),
        ),
        "mqdedup, batch 500, bulk handle_batch": (
            count,
            lambda: run_mqdedup(Bulk, engine, args.bootstrap, topic, count),
        ),
        "mqdedup, batch 500, per-message handle": (
            count,
            lambda: run_mqdedup(PerMessage, engine, args.bootstrap, topic, count),
        ),
        "per-message transactions (failure_isolation='transaction')": (
            slow,
            lambda: run_mqdedup(
                PerMessage, engine, args.bootstrap, topic, slow, failure_isolation="transaction"
            ),
        ),
        "per-message transactions, batch_size=1": (
            slow,
            lambda: run_mqdedup(PerMessage, engine, args.bootstrap, topic, slow, batch_size=1),
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for run in range(1, args.runs + 1):
        for name, (_, measure) in variants.items():
            rate = measure()
            rates[name].append(rate)
            print(f"run {run}: {name}: {rate:,.0f} msgs/s", flush=True)

    medians = {name: statistics.median(values) for name, values in rates.items()}
    raw = medians["raw kafka-python poll loop, no DB"]
    bulk = medians["mqdedup, batch 500, bulk handle_batch"]
    per_tx = medians["per-message transactions (failure_isolation='transaction')"]
    print()
    print(f"Kafka consumer throughput, medians of {args.runs} runs ({PARTITIONS} partitions)")
    print()
    print("| variant | messages | msgs/s (median) | runs | vs raw |")
    print("|---|---:|---:|---|---:|")
    for name, (messages, _) in variants.items():
        runs = ", ".join(f"{v:,.0f}" for v in rates[name])
        print(
            f"| {name} | {messages:,} | {medians[name]:,.0f} | {runs} | {medians[name] / raw:.0%} |"
        )
    print()
    print(
        f"Goal 1 - bulk handler >= 50% of the raw loop: {bulk / raw:.0%} "
        f"({'met' if bulk >= 0.5 * raw else 'NOT met'})"
    )
    print(
        f"Goal 2 - bulk handler >= 5x per-message transactions: {bulk / per_tx:.1f}x "
        f"({'met' if bulk >= 5 * per_tx else 'NOT met'})"
    )
    admin = kafka.KafkaAdminClient(bootstrap_servers=args.bootstrap)
    admin.delete_topics([topic], raise_errors=False)
    admin.close()
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
