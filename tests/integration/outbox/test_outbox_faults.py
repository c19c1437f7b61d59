"""The outbox under faults: relays killed with SIGKILL, a broker down for 20 s, a whole chain.

Processes are real subprocesses killed with ``kill -9`` at the dangerous moments (after
publishing, before marking); the broker outage uses a private RabbitMQ instance started
by the test (never the shared one); the relay kills and the chain run on the shared
brokers meanwhile, in one test.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pika
import pytest
from sqlalchemy.orm import Session

from mqdedup.consumers.metrics import Metrics
from mqdedup.outbox import OutboxWriter, Relay, RelayConfig
from mqdedup.outbox.writer import outgoing_message_id
from mqdedup.rabbitmq import RabbitMQConsumer, RabbitMQPublisher
from mqdedup.rabbitmq.topology import declare_topology
from mqdedup.stopping import StopToken
from tests.integration.outbox.chain_worker import build
from tests.integration.outbox.helpers import (
    OutboxDb,
    RelayProcess,
    WorkerProcess,
    poll_until,
    relay_thread,
)
from tests.services import KafkaHelper, PrivateRabbitMQ, RabbitAdmin, kill_session_timeout_ms

pytestmark = pytest.mark.integration


def write_rows(db: OutboxDb, queue: str, count: int, start: int = 0) -> list[str]:
    """``count`` rows for the default exchange → ``queue``, 100 per transaction."""
    ids: list[str] = []
    for first in range(start, start + count, 100):
        with Session(db.engine) as session, session.begin():
            writer = OutboxWriter(session, prefix=db.prefix)
            for number in range(first, min(first + 100, start + count)):
                ids.append(
                    writer.publish(
                        {"n": number}, exchange="", routing_key=queue, key=f"k{number % 50}"
                    )
                )
    return ids


def receiver(db: OutboxDb, queue: str, rabbitmq_url: str) -> RabbitMQConsumer:
    consumer = build(
        {"role": "receiver", "queue": queue, "rabbitmq": rabbitmq_url, "prefix": db.prefix}
    )
    assert isinstance(consumer, RabbitMQConsumer)
    return consumer


def consume_all(
    db: OutboxDb, consumer: RabbitMQConsumer, deliveries: int, timeout: float = 120.0
) -> Metrics:
    """Run ``consumer`` (real RabbitMQ, real dedup) until it handled ``deliveries``."""
    stop = StopToken()
    metrics = Metrics()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer.run(db.engine, stop=stop, metrics=metrics)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        poll_until(
            lambda: metrics.processed + metrics.duplicates >= deliveries or bool(errors),
            timeout,
            f"{deliveries} deliveries handled by the downstream consumer",
        )
    finally:
        stop.request()
        thread.join(timeout=60)
    assert not errors, errors
    return metrics


def relay_killed_mid_batch_five_times_publishes_all_and_the_consumer_applies_each_once(
    db: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    queue = rabbit.queue()
    consumer = receiver(db, queue, rabbitmq_url)
    declare_topology(rabbit.channel(), consumer.topology())
    rabbit.created.append(f"{queue}.dlq")
    ids = write_rows(db, queue, 5_000)
    config = {
        "database_url": db.url,
        "prefix": db.prefix,
        "rabbitmq": rabbitmq_url,
        "batch_size": 200,
        "lease": 2.0,
        "poll_interval": 0.2,
    }
    killed = {**config, "batch_pause": 0.05}  # slower, so the kills land before the end
    rng = random.Random(5)
    held_rows = 0
    for kill in range(5):
        published_before = rabbit.depth(queue)
        if kill % 2 == 0:  # at the most dangerous moment: published, not marked
            relay = RelayProcess({**killed, "hold_batch": rng.randint(2, 4)})
            relay.wait_for_line("UNMARKED", 60)
            held_rows += int(relay.value_of("UNMARKED"))
        else:  # at a random moment while it publishes
            relay = RelayProcess(killed)
            target = published_before + rng.randint(300, 700)
            poll_until(lambda t=target: rabbit.depth(queue) >= t, 60, "relay progress")
        relay.kill()
    assert db.status().pending > 0, "the kills came before the end"

    final = RelayProcess(config)
    final.wait_for_line("STARTED", 30)
    poll_until(lambda: db.status().pending == 0, 120, "every row published")
    final_metrics = final.stop()

    deliveries = rabbit.depth(queue)
    assert deliveries >= 5_000 + held_rows, "the held batches were published again"
    metrics = consume_all(db, consumer, deliveries)
    assert rabbit.depth(queue) == 0

    counts = db.event_counts("B")
    assert set(counts) == set(ids), "every row published at least once"
    assert set(counts.values()) == {1}, "each message id applied exactly once"
    assert (metrics.processed, metrics.duplicates) == (5_000, deliveries - 5_000)
    status = db.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 5_000)
    assert final_metrics["failed"] == 0


#: The relay's publisher timeouts and broker back-off in the outage test; the outage (20 s)
#: lasts four confirm timeouts and ten back-offs, so every kind of wait has run out several
#: times while the rows must still be pending, never failed.
CONFIRM_TIMEOUT = 5.0
BROKER_BACKOFF_MAX = 2.0
OUTAGE_SECONDS = 20.0


def broker_down_for_20_seconds_rows_wait_then_publish_none_failed_or_lost(
    db: OutboxDb, private_rabbit: PrivateRabbitMQ
) -> None:
    service, url = private_rabbit.service, private_rabbit.url
    queue = f"t-outbox-outage-{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_declare(queue, durable=True)
    connection.close()
    relay = Relay(
        db.engine,
        {"rabbitmq": RabbitMQPublisher(url, confirm_timeout=CONFIRM_TIMEOUT, connect_timeout=2.0)},
        prefix=db.prefix,
        config=RelayConfig(
            broker_backoff_max=BROKER_BACKOFF_MAX, poll_interval=0.2, batch_size=200
        ),
    )
    ids: list[str] = []
    with relay_thread(relay):
        ids += write_rows(db, queue, 1_000)
        poll_until(lambda: db.status().published == 1_000, 60, "the first rows published")

        service.kill()  # the broker is gone; keep writing during the outage
        down_since = time.monotonic()
        for start in range(1_000, 2_000, 100):
            ids += write_rows(db, queue, 100, start=start)
            time.sleep(0.5)  # paced writes during the outage (not a synchronisation)
        while time.monotonic() - down_since < OUTAGE_SECONDS:
            status = db.status()
            assert status.failed == 0, "an outage must never fail rows"
            time.sleep(0.5)  # the outage's length is the point; rows must wait all along
        assert db.status().pending == 1_000, "rows written during the outage wait"

        service.start()
        poll_until(lambda: db.status().pending == 0, 90, "the waiting rows published")
    metrics = relay.metrics

    status = db.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 2_000)
    assert metrics.broker_outages >= 1 and metrics.failed == 0
    admin = RabbitAdmin(url)
    try:
        delivered = {properties.message_id for properties, _ in admin.drain(queue, 2_000)}
    finally:
        admin.close()
    assert delivered == set(ids), "nothing lost: every row reached the queue"


def chain_kafka_to_consumer_a_to_relay_to_rabbitmq_to_consumer_b_with_duplicates_and_crashes(
    db: OutboxDb,
    kafka_helper: KafkaHelper,
    rabbit: RabbitAdmin,
    kafka_bootstrap: str,
    rabbitmq_url: str,
) -> None:
    topic = kafka_helper.create_topic(partitions=3, kind="chain-in")
    queue = rabbit.queue("chain-b")
    group = f"chain-a-{uuid.uuid4().hex[:8]}"
    unique = [f"in-{number:05d}" for number in range(4_000)]
    rng = random.Random(11)
    sent = unique + rng.sample(unique, 1_000)  # duplicates injected at the start
    rng.shuffle(sent)
    producer = kafka_tool_producer(kafka_bootstrap)
    for message_id in sent:
        producer.send(
            topic,
            key=message_id.encode(),
            value=json.dumps({"id": message_id}).encode(),
            headers=[("message-id", message_id.encode())],
        )
    producer.flush(timeout=60)
    producer.close()

    base = {"database_url": db.url, "prefix": db.prefix, "queue": queue}
    forwarder = {
        **base,
        "role": "forwarder",
        "topic": topic,
        "group": group,
        "kafka": kafka_bootstrap,
        "batch_size": 50,
        # the restarted A waits for the group to drop the killed one: sooner where allowed
        "kafka_config": {"session_timeout_ms": kill_session_timeout_ms(kafka_bootstrap)},
    }
    receiver_config = {**base, "role": "receiver", "rabbitmq": rabbitmq_url, "batch_size": 50}
    relay_config = {
        **base,
        "rabbitmq": rabbitmq_url,
        "batch_size": 100,
        "lease": 2.0,
        "poll_interval": 0.2,
    }
    processes: list[WorkerProcess] = []

    def start(process: WorkerProcess) -> WorkerProcess:
        processes.append(process)
        return process

    try:
        a = start(WorkerProcess(forwarder))
        relay = start(RelayProcess({**relay_config, "hold_batch": 3}))
        relay.wait_for_line("UNMARKED", 120)
        assert int(relay.value_of("UNMARKED")) > 0
        relay.kill()  # crash in the relay: published, not marked
        start(RelayProcess(relay_config))
        poll_until(lambda: sum(db.event_counts("A").values()) >= 1_500, 120, "A's progress")
        a.kill()  # crash in A: committed batches whose offsets are not committed
        assert len(db.event_counts("A")) < len(unique), "A was killed mid-run"
        start(WorkerProcess(forwarder))
        b = start(WorkerProcess(receiver_config))
        poll_until(lambda: sum(db.event_counts("B").values()) >= 1_000, 120, "B's progress")
        b.kill()  # crash in B: committed, maybe not acked
        assert len(db.event_counts("B")) < len(unique), "B was killed mid-run"
        start(WorkerProcess(receiver_config))
        expected_b = {outgoing_message_id(group, message_id, 0) for message_id in unique}
        poll_until(
            lambda: set(db.event_counts("B")) == expected_b and db.status().pending == 0,
            180,
            "B to have applied every message",
        )
    finally:
        for process in processes:
            if process.alive():
                process.stop()

    counts_a = db.event_counts("A")
    counts_b = db.event_counts("B")
    assert set(counts_a) == set(unique) and set(counts_a.values()) == {1}
    assert set(counts_b) == expected_b and set(counts_b.values()) == {1}, "B's effects = unique"
    status = db.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 4_000)


@pytest.mark.slow
def test_broker_down_20_seconds_beside_relays_killed_five_times_and_a_chain_with_crashes(
    outbox_dbs: Callable[[], OutboxDb],
    private_rabbit: PrivateRabbitMQ,
    kafka_helper: KafkaHelper,
    kafka_bootstrap: str,
    rabbitmq_url: str,
) -> None:
    """Three outbox fault runs side by side, each with tables of its own and asserting
    its own outcome, so the outage's 20 s are waited for once:

    * the private RabbitMQ down for 20 s under a relay: rows wait, then publish, none
      failed or lost (this thread);
    * on the shared RabbitMQ, relays killed with ``kill -9`` five times mid-batch: all
      rows published, the consumer applies each once (a thread);
    * on the shared brokers, the whole chain Kafka -> A -> relay -> RabbitMQ -> B with
      duplicates and crashes (a thread).
    """
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="outbox-fault") as pool:
        admins = [RabbitAdmin(rabbitmq_url) for _ in range(2)]  # pika: one per thread
        runs = [
            pool.submit(
                relay_killed_mid_batch_five_times_publishes_all_and_the_consumer_applies_each_once,
                outbox_dbs(),
                admins[0],
                rabbitmq_url,
            ),
            pool.submit(
                chain_kafka_to_consumer_a_to_relay_to_rabbitmq_to_consumer_b_with_duplicates_and_crashes,
                outbox_dbs(),
                kafka_helper,
                admins[1],
                kafka_bootstrap,
                rabbitmq_url,
            ),
        ]
        try:
            broker_down_for_20_seconds_rows_wait_then_publish_none_failed_or_lost(
                outbox_dbs(), private_rabbit
            )
        finally:
            wait(runs)
            for admin in admins:
                admin.close()
    for future in runs:
        future.result()


def kafka_tool_producer(bootstrap: str) -> Any:
    import kafka

    return kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
