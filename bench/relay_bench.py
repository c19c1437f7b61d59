"""Relay benchmark: throughput against the fastest equally safe raw publish loop, and latency.

    python bench/relay_bench.py [--rows 100000] [--runs 3] [--latency-rows 1000]
                                [--database URL ...] [--brokers kafka,rabbitmq]

Needs ``MQDEDUP_TEST_DATABASE_URL`` (PostgreSQL), ``MQDEDUP_KAFKA_BOOTSTRAP`` and
``MQDEDUP_RABBITMQ_URL`` (``scripts/services.sh env``). ``--database URL`` (repeatable)
measures other databases instead, e.g. PostgreSQL and MariaDB side by side in one run:
``--database "$MQDEDUP_TEST_DATABASE_URL" --database "$MQDEDUP_TEST_MARIADB_URL"``. It
uses its own table prefix, topics and queues and removes them at the end.

Throughput, per broker, interleaved and repeated ``--runs`` times (medians reported):

* raw loop: the same messages (key, ~100-byte JSON payload, ``message-id`` header) from
  memory. Kafka: kafka-python ``acks=all`` + idempotence, one ``flush()`` per relay batch, with
  the relay's producer batching (``RELAY_PRODUCER_BATCHING``: without it the raw loop
  sends many small produce requests and is about a third slower).
  RabbitMQ: pika ``SelectConnection``, persistent, ``mandatory``, publisher confirms
  handled asynchronously with a window of 1000 unconfirmed messages.
* relay: ``--rows`` pending outbox rows (loaded with COPY on PostgreSQL, multi-row
  INSERTs elsewhere; not timed) published by ``Relay.drain()`` with the default
  settings (batches of 2,000, published rows deleted), on each database in turn.

Latency: ``--latency-rows`` single-row transactions, one every few milliseconds, with a
relay running in a thread; commit-to-publish = from ``commit()`` returning to the
publisher's confirm/acknowledgement, with NOTIFY (PostgreSQL only) and with polling only
(1 s interval). ``--latency-rows 0`` skips it.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kafka
import pika
from sqlalchemy import Engine, insert, text
from sqlalchemy.orm import Session

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.kafka import KafkaPublisher
from mqdedup.kafka.publisher import RELAY_PRODUCER_BATCHING
from mqdedup.outbox import OutboxWriter, Relay, RelayConfig
from mqdedup.outbox.publishers import OutboxRecord, Publisher, PublishResult
from mqdedup.outbox.writer import shard_hash
from mqdedup.rabbitmq import RabbitMQPublisher
from mqdedup.stopping import StopToken

#: The raw Kafka loop flushes once per relay batch (the relay's default size).
BATCH = RelayConfig().batch_size
WINDOW = 1000


@dataclass(frozen=True)
class Outgoing:
    message_id: str
    key: bytes
    payload: bytes


def make_messages(count: int) -> list[Outgoing]:
    messages = []
    for number in range(count):
        body = {"order": number, "amount": 12345, "currency": "EUR", "note": "x" * 40}
        messages.append(
            Outgoing(str(uuid.uuid4()), f"k{number % 1000}".encode(), json.dumps(body).encode())
        )
    return messages


# -- raw loops -----------------------------------------------------------------------------


def raw_kafka(bootstrap: str, topic: str, messages: Sequence[Outgoing]) -> float:
    producer = kafka.KafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, **RELAY_PRODUCER_BATCHING
    )
    producer.send(topic, value=b"warm-up")
    producer.flush()
    started = time.perf_counter()
    for first in range(0, len(messages), BATCH):
        for message in messages[first : first + BATCH]:
            producer.send(
                topic,
                key=message.key,
                value=message.payload,
                headers=[("message-id", message.message_id.encode())],
            )
        producer.flush()
    elapsed = time.perf_counter() - started
    producer.close()
    return len(messages) / elapsed


def raw_rabbitmq(url: str, queue: str, messages: Sequence[Outgoing]) -> float:
    """Persistent, mandatory publishes with asynchronous confirms in a window."""
    state: dict[str, Any] = {"sent": 0, "tag": 0, "started": 0.0, "elapsed": 0.0}
    outstanding: deque[int] = deque()
    channel: Any = None

    def publish_more() -> None:
        while state["sent"] < len(messages) and len(outstanding) < WINDOW:
            message = messages[state["sent"]]
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=message.payload,
                properties=pika.BasicProperties(
                    delivery_mode=pika.DeliveryMode.Persistent,
                    message_id=message.message_id,
                    headers={"message-id": message.message_id},
                ),
                mandatory=True,
            )
            state["sent"] += 1
            state["tag"] += 1
            outstanding.append(state["tag"])

    def on_confirm(frame: Any) -> None:
        method = frame.method
        if method.multiple:
            while outstanding and outstanding[0] <= method.delivery_tag:
                outstanding.popleft()
        elif method.delivery_tag in outstanding:
            outstanding.remove(method.delivery_tag)
        if state["sent"] == len(messages) and not outstanding:
            state["elapsed"] = time.perf_counter() - state["started"]
            connection.close()
        else:
            publish_more()

    def on_confirm_mode(_frame: Any) -> None:
        state["started"] = time.perf_counter()
        publish_more()

    def on_channel(opened: Any) -> None:
        nonlocal channel
        channel = opened
        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=on_confirm_mode)

    connection = pika.SelectConnection(
        pika.URLParameters(url),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=lambda _c, error: connection.ioloop.stop(),
        on_close_callback=lambda _c, _reason: connection.ioloop.stop(),
    )
    connection.ioloop.start()
    if not state["elapsed"]:
        raise RuntimeError("raw RabbitMQ loop did not finish")
    return len(messages) / state["elapsed"]


# -- relay ---------------------------------------------------------------------------------

COLUMNS = (
    "message_id, broker, destination, routing_key, message_key, shard_hash, headers, "
    "properties, payload, state, attempts, created_at, available_at"
)


def load_rows(
    engine: Engine, prefix: str, broker: str, target: str, messages: Sequence[Outgoing]
) -> None:
    """Pending outbox rows as the writer would store them, loaded with COPY (PostgreSQL)."""
    if engine.dialect.name != "postgresql":
        load_rows_insert(engine, prefix, broker, target, messages)
        return
    table = schema(prefix).outbox.name
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        with cursor.copy(f"COPY {table} ({COLUMNS}) FROM STDIN") as copy:
            for message in messages:
                headers = {"message-id": message.message_id}
                if broker == "kafka":
                    destination, routing_key, properties = target, None, None
                else:
                    destination, routing_key = "", target
                    properties = json.dumps(
                        {"message_id": message.message_id, "content_type": "application/json"}
                    )
                copy.write_row(
                    (
                        message.message_id,
                        broker,
                        destination,
                        routing_key,
                        message.key,
                        shard_hash(message.key, message.message_id),
                        json.dumps(headers),
                        properties,
                        message.payload,
                        "pending",
                        0,
                        "now",
                        "now",
                    )
                )
        raw.commit()
    finally:
        raw.close()


def load_rows_insert(
    engine: Engine, prefix: str, broker: str, target: str, messages: Sequence[Outgoing]
) -> None:
    """Pending outbox rows as the writer would store them, with multi-row INSERTs."""
    table = schema(prefix).outbox
    now = datetime.now(UTC)
    rows = []
    for message in messages:
        headers = {"message-id": message.message_id}
        if broker == "kafka":
            destination, routing_key, properties = target, None, None
        else:
            destination, routing_key = "", target
            properties = {"message_id": message.message_id, "content_type": "application/json"}
        rows.append(
            {
                "message_id": message.message_id,
                "broker": broker,
                "destination": destination,
                "routing_key": routing_key,
                "message_key": message.key,
                "shard_hash": shard_hash(message.key, message.message_id),
                "headers": headers,
                "properties": properties,
                "payload": message.payload,
                "state": "pending",
                "attempts": 0,
                "created_at": now,
                "available_at": now,
            }
        )
    for start in range(0, len(rows), 2000):
        with engine.begin() as connection:
            connection.execute(insert(table).values(rows[start : start + 2000]))


def database_label(engine: Engine) -> str:
    """``postgresql``, ``mariadb``, ``mysql`` or ``sqlite``."""
    if getattr(engine.dialect, "is_mariadb", False):
        return "mariadb"
    return engine.dialect.name


def relay_throughput(
    engine: Engine,
    prefix: str,
    broker: str,
    target: str,
    publisher: Publisher,
    messages: Sequence[Outgoing],
    config: RelayConfig | None = None,
) -> float:
    relay = Relay(engine, {broker: publisher}, prefix=prefix, config=config)
    try:
        load_rows(engine, prefix, broker, target, messages[:1])  # warm-up: connect, shards
        relay.drain(timeout=60)
        load_rows(engine, prefix, broker, target, messages[1:])
        started = time.perf_counter()
        relay.drain(timeout=1800)
        elapsed = time.perf_counter() - started
    finally:
        relay.close()
    if relay.metrics.published != len(messages) or relay.metrics.failed:
        raise RuntimeError(f"relay published {relay.metrics.published} of {len(messages)}")
    return (len(messages) - 1) / elapsed


# -- latency -------------------------------------------------------------------------------


class StampingPublisher:
    """Records when each message id was confirmed by the broker."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.published: dict[str, float] = {}

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        results = self.inner.publish_batch(records)
        now = time.perf_counter()
        for record, result in zip(records, results, strict=True):
            if result.ok:
                self.published.setdefault(record.message_id, now)
        return results

    def keepalive(self) -> None:
        self.inner.keepalive()

    def close(self) -> None:
        self.inner.close()


def latency(
    engine: Engine,
    prefix: str,
    broker: str,
    destination: dict[str, Any],
    publisher: Publisher,
    count: int,
    listen: bool,
) -> tuple[float, float]:
    stamping = StampingPublisher(publisher)
    relay = Relay(
        engine,
        {broker: stamping},
        prefix=prefix,
        config=RelayConfig(listen=listen, poll_interval=1.0),
    )
    stop = StopToken()
    thread = threading.Thread(target=relay.run, args=(stop,))
    thread.start()
    committed: dict[str, float] = {}
    rng = random.Random(1)
    try:
        with Session(engine) as session, session.begin():  # warm-up (connections, shards)
            warm = OutboxWriter(session, prefix=prefix).publish(b"warm-up", **destination)
        wait(lambda: warm in stamping.published, 30)
        for number in range(count):
            with Session(engine) as session, session.begin():
                message_id = OutboxWriter(session, prefix=prefix).publish(
                    {"n": number}, key=f"k{number % 100}", **destination
                )
            committed[message_id] = time.perf_counter()
            time.sleep(rng.uniform(0.002, 0.008))  # pacing: single transactions, not a burst
        wait(lambda: all(m in stamping.published for m in committed), 60)
    finally:
        stop.request()
        thread.join(timeout=60)
    values = sorted(max(0.0, stamping.published[m] - t) * 1000 for m, t in committed.items())
    return statistics.median(values), values[int(len(values) * 0.99) - 1]


def wait(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark wait timed out")
        time.sleep(0.01)


# -- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-rows", type=int, default=1_000)
    parser.add_argument("--brokers", default="kafka,rabbitmq")
    parser.add_argument(
        "--database",
        "--database-url",
        dest="databases",
        action="append",
        metavar="URL",
        help="database to measure (repeatable; default MQDEDUP_TEST_DATABASE_URL)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    amqp_url = os.environ.get("MQDEDUP_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    urls = args.databases or [os.environ.get("MQDEDUP_TEST_DATABASE_URL", "")]
    if not all(urls):
        parser.error("set MQDEDUP_TEST_DATABASE_URL or give --database URL")
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    prefix = f"bench_{uuid.uuid4().hex[:8]}_"
    engines: dict[str, Engine] = {}
    for url in urls:
        engine = create_engine(url)
        init_schema(engine, prefix)  # connects: the dialect knows MariaDB from MySQL now
        label = database_label(engine)
        if label in engines:
            parser.error(f"--database given twice for {label}")
        engines[label] = engine
    outbox = schema(prefix).outbox.name
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    rabbit = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = rabbit.channel()
    topics: list[str] = []
    queues: list[str] = []

    def new_target(broker: str) -> str:
        name = f"bench-relay-{uuid.uuid4().hex[:10]}"
        if broker == "kafka":
            admin.create_topics({name: {"num_partitions": 3}})
            topics.append(name)
        else:
            channel.queue_declare(name, durable=True)
            queues.append(name)
        return name

    def purge_queues() -> None:  # keep the broker's memory flat between runs
        for name in queues:
            channel.queue_purge(name)

    raw: dict[str, list[float]] = {b: [] for b in brokers}
    relayed: dict[tuple[str, str], list[float]] = {(d, b): [] for d in engines for b in brokers}
    messages = make_messages(args.rows)
    latencies: dict[tuple[str, str, str], tuple[float, float]] = {}
    try:
        for run in range(1, args.runs + 1):
            for broker in brokers:
                target = new_target(broker)
                if broker == "kafka":
                    raw[broker].append(raw_kafka(bootstrap, target, messages))
                else:
                    raw[broker].append(raw_rabbitmq(amqp_url, target, messages))
                    purge_queues()
                for label, engine in engines.items():
                    publisher: Publisher = (
                        KafkaPublisher(bootstrap)
                        if broker == "kafka"
                        else RabbitMQPublisher(amqp_url, window=WINDOW)
                    )
                    fresh = make_messages(args.rows)  # new ids: the outbox ids are unique
                    relayed[(label, broker)].append(
                        relay_throughput(engine, prefix, broker, target, publisher, fresh)
                    )
                    if broker == "rabbitmq":
                        purge_queues()
                    with engine.begin() as connection:
                        connection.execute(text(f"TRUNCATE TABLE {outbox}"))
                    print(
                        f"run {run} {broker}: raw {raw[broker][-1]:,.0f} msgs/s, "
                        f"relay on {label} {relayed[(label, broker)][-1]:,.0f} rows/s",
                        file=sys.stderr,
                        flush=True,
                    )
        for label, engine in engines.items():
            if args.latency_rows <= 0:
                break
            modes = [("polling (1 s)", False)]
            if engine.dialect.name == "postgresql":
                modes.insert(0, ("NOTIFY", True))
            for broker in brokers:
                target = new_target(broker)
                destination = (
                    {"topic": target}
                    if broker == "kafka"
                    else {"exchange": "", "routing_key": target}
                )
                for mode, listen in modes:
                    publisher = (
                        KafkaPublisher(bootstrap)
                        if broker == "kafka"
                        else RabbitMQPublisher(amqp_url)
                    )
                    latencies[(label, broker, mode)] = latency(
                        engine, prefix, broker, destination, publisher, args.latency_rows, listen
                    )
                    print(
                        f"latency {label} {broker} {mode}: {latencies[(label, broker, mode)]}",
                        file=sys.stderr,
                    )
    finally:
        for engine in engines.values():
            schema(prefix).metadata.drop_all(engine)
            engine.dispose()
        if topics:
            admin.delete_topics(topics)
        for name in queues:
            channel.queue_delete(name)
        rabbit.close()
        admin.close()
    out = io.StringIO()
    out.write(
        f"\n### Relay throughput ({args.rows:,} rows, median of {args.runs}, "
        f"batches of {BATCH})\n\n"
        "| database | broker | raw loop msgs/s | relay rows/s | relay / raw | goal |\n"
        "|---|---|---|---|---|---|\n"
    )
    for (label, broker), values in relayed.items():
        raw_median = statistics.median(raw[broker])
        relay_median = statistics.median(values)
        ratio = relay_median / raw_median
        out.write(
            f"| {label} | {broker} | {raw_median:,.0f} | {relay_median:,.0f} | {ratio:.0%} | "
            f"{'met' if ratio >= 0.8 else 'missed'} (>= 80%) |\n"
        )
    if latencies:
        out.write(
            f"\n### Commit-to-publish latency ({args.latency_rows:,} single-row transactions)"
            "\n\n| database | broker | wake-up | p50 ms | p99 ms |\n|---|---|---|---|---|\n"
        )
        for (label, broker, mode), (p50, p99) in latencies.items():
            out.write(f"| {label} | {broker} | {mode} | {p50:.1f} | {p99:.1f} |\n")
    out.write(
        "\nRuns (raw / relay): "
        + "; ".join(
            f"{label} {b}: "
            + ", ".join(
                f"{r:,.0f}/{s:,.0f}" for r, s in zip(raw[b], relayed[(label, b)], strict=True)
            )
            for label, b in relayed
        )
        + "\n"
    )
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
