"""Relay throughput against a raw publish loop, and commit-to-publish latency.

Reuses ``bench/relay_bench.py`` (the raw loops, the COPY-loaded outbox, ``Relay.drain``
and the stamping publisher for latency) and only arranges the runs.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import kafka
import pika
from sqlalchemy import text

from bench import relay_bench as rl
from bench.suite_common import Row, Section, Settings, Sizes, percentile, progress
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.kafka import KafkaPublisher
from mqdedup.outbox import RelayConfig
from mqdedup.outbox.publishers import Publisher
from mqdedup.rabbitmq import RabbitMQPublisher

BROKERS = ("kafka", "rabbitmq")


def relay_suite(settings: Settings, sizes: Sizes) -> tuple[Section, Section]:
    """(throughput section, latency section)."""
    rows = sizes.relay_rows
    throughput = Section(
        "relay",
        "Outbox relay throughput vs a raw publish loop",
        f"{rows:,} pending outbox rows (~100-byte JSON, key, message-id header; loaded with "
        "COPY, not timed) published by `Relay.drain()` with default settings (batches of "
        f"{rl.BATCH:,}, rows deleted and counted per hour) and with `delete_published=False` "
        "(rows marked published and kept) against the equally safe raw loop over the same "
        f"messages from memory: Kafka `acks=all` + idempotence with one flush per {rl.BATCH:,} "
        "(the relay's batch; the raw loop is as fast with 500) and the relay's producer "
        "batching (linger until the flush, 256 KiB batches); RabbitMQ persistent, mandatory, "
        f"asynchronous publisher confirms (window {rl.WINDOW:,}, the raw loop's best; the "
        "relay's publisher uses the same window; the raw loop sends with pika's `basic_publish`, "
        "the relay encodes its frames itself and writes a window's worth at once). Raw loop "
        "first in odd runs, last in even runs.",
    )
    latency = Section(
        "latency",
        "Commit-to-publish latency",
        f"{sizes.latency_rows:,} single-row outbox transactions, one every 2-8 ms, with a "
        "relay running; time from `commit()` returning to the broker's acknowledgement. "
        "NOTIFY wakes the relay at once; polling only waits for the 1 s poll interval.",
    )
    bootstrap, url = settings.kafka_bootstrap, settings.rabbitmq_url
    engine = create_engine(settings.database_url)
    prefix = f"bench_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    outbox = schema(prefix).outbox.name
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    rabbit = pika.BlockingConnection(pika.URLParameters(url))
    channel = rabbit.channel()
    topics: list[str] = []
    queues: list[str] = []

    def new_target(broker: str) -> str:
        name = f"bench-suite-relay-{uuid.uuid4().hex[:10]}"
        if broker == "kafka":
            admin.create_topics({name: {"num_partitions": 3}})
            topics.append(name)
        else:
            channel.queue_declare(name, durable=True)
            queues.append(name)
        return name

    def purge_queues() -> None:
        for name in queues:
            channel.queue_purge(name)

    raw: dict[str, list[float]] = {b: [] for b in BROKERS}
    relayed: dict[str, list[float]] = {b: [] for b in BROKERS}
    keeping: dict[str, list[float]] = {b: [] for b in BROKERS}
    messages = rl.make_messages(rows)

    def measure_raw(broker: str, target: str) -> None:
        if broker == "kafka":
            raw[broker].append(rl.raw_kafka(bootstrap, target, messages))
        else:
            raw[broker].append(rl.raw_rabbitmq(url, target, messages))
            purge_queues()

    def measure_relay(broker: str, target: str, results: list[float], config: RelayConfig) -> None:
        publisher: Publisher = (
            KafkaPublisher(bootstrap)
            if broker == "kafka"
            else RabbitMQPublisher(url, window=rl.WINDOW)
        )
        results.append(
            rl.relay_throughput(
                engine, prefix, broker, target, publisher, rl.make_messages(rows), config
            )
        )
        if broker == "rabbitmq":
            purge_queues()
        with engine.begin() as connection:
            connection.execute(text(f"TRUNCATE {outbox}"))

    try:
        for run in range(1, sizes.runs + 1):
            for broker in BROKERS:
                target = new_target(broker)
                started = time.perf_counter()
                # The raw loop goes first in odd runs and last in even ones, so neither
                # side always inherits the broker's cleanup of the run before it.
                if run % 2:
                    measure_raw(broker, target)
                measure_relay(broker, target, relayed[broker], RelayConfig())
                measure_relay(broker, target, keeping[broker], RelayConfig(delete_published=False))
                if not run % 2:
                    measure_raw(broker, target)
                progress(
                    f"relay run {run} {broker}: raw {raw[broker][-1]:,.0f} msgs/s, relay "
                    f"{relayed[broker][-1]:,.0f} rows/s, rows kept {keeping[broker][-1]:,.0f} "
                    f"rows/s ({time.perf_counter() - started:.1f} s)"
                )
        for broker in BROKERS:
            throughput.rows.append(Row(f"{broker}: raw publish loop", raw[broker], "msgs/s"))
            throughput.rows.append(Row(f"{broker}: mqdedup relay", relayed[broker], "rows/s"))
            throughput.rows.append(
                Row(
                    f"{broker}: mqdedup relay, rows kept (delete_published=False)",
                    keeping[broker],
                    "rows/s",
                )
            )

        for broker in BROKERS:
            target = new_target(broker)
            destination: dict[str, Any] = (
                {"topic": target} if broker == "kafka" else {"exchange": "", "routing_key": target}
            )
            for mode, listen in (("NOTIFY", True), ("polling (1 s)", False)):
                p50s: list[float] = []
                p99s: list[float] = []
                for _ in range(sizes.runs):
                    publisher = (
                        KafkaPublisher(bootstrap) if broker == "kafka" else (RabbitMQPublisher(url))
                    )
                    p50, p99 = rl.latency(
                        engine, prefix, broker, destination, publisher, sizes.latency_rows, listen
                    )
                    p50s.append(p50)
                    p99s.append(p99)
                    progress(f"latency {broker} {mode}: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
                latency.rows.append(Row(f"{broker}, {mode}: p50", p50s, "ms"))
                latency.rows.append(Row(f"{broker}, {mode}: p99", p99s, "ms"))
            if broker == "rabbitmq":
                purge_queues()
    finally:
        schema(prefix).metadata.drop_all(engine)
        if topics:
            admin.delete_topics(topics)
        for name in queues:
            channel.queue_delete(name)
        rabbit.close()
        admin.close()
        engine.dispose()
    for broker in BROKERS:
        ratio = statistics.median(relayed[broker]) / statistics.median(raw[broker])
        throughput.extra[f"{broker} relay / raw"] = f"{ratio:.0%}"
        ratio = statistics.median(keeping[broker]) / statistics.median(raw[broker])
        throughput.extra[f"{broker} relay (rows kept) / raw"] = f"{ratio:.0%}"
    _ = percentile  # (p99s come from relay_bench's own percentile)
    return throughput, latency
