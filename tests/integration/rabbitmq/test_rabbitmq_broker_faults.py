"""RabbitMQ broker-side faults never stall a worker silently (issue #19).

* the broker closes the consuming channel (``consumer_timeout``) mid-batch: the worker
  notices, is not ready while detached, reattaches and every effect happens once;
* a memory alarm while poisons are dead-lettered: acks go on (dead letters wait on
  their own publishing connection); the relay pauses without failing rows and leaves
  no blocked connection behind;
* a dead-letter queue that refuses (``x-max-length`` + ``reject-publish``): the
  transport raises ``DeadLetterRefusedError`` promptly;
* a topology the broker rejects after a reconnect: one clear error, exit code 3.

Tests that change broker settings run on a PRIVATE node.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pika
import pytest
from sqlalchemy.orm import Session

from mqdedup import Message, RetryPolicy
from mqdedup.cli import exitcodes
from mqdedup.cli.health import snapshot_ready
from mqdedup.consumers.transport import DeadLetter
from mqdedup.errors import DeadLetterRefusedError
from mqdedup.outbox import OutboxStore, OutboxWriter, Relay, RelayConfig
from mqdedup.rabbitmq import RabbitMQPublisher
from tests.integration.outbox.helpers import relay_thread
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import (
    ThreadedWorker,
    make_consumer,
    order_counts,
    pids_matching,
    rabbitmqctl,
)
from tests.services import REPO, PrivateRabbitMQ, RabbitAdmin, wait_for

pytestmark = [pytest.mark.integration]
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.05, max_backoff=0.1)


@pytest.fixture
def node(private_rabbit: PrivateRabbitMQ) -> PrivateRabbitMQ:
    """The run's private node (settings changed here are undone after each test)."""
    return private_rabbit


class Readiness:
    """Samples a worker's readiness (as ``/healthz`` computes it) in a tight loop."""

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot
        self.seen_not_ready = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not snapshot_ready(self.snapshot()):
                self.seen_not_ready = True
            time.sleep(0.0005)

    def __enter__(self) -> Readiness:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.slow
def test_consumer_timeout_closes_the_channel_mid_batch_worker_reattaches_effects_once(
    db: Database, node: PrivateRabbitMQ
) -> None:
    node.set_env("consumer_timeout", 2000)
    node.set_env("channel_tick_interval", 500)
    queue = f"ct-{uuid.uuid4().hex[:8]}"
    slow_id = "m-0005"
    slowed = threading.Event()

    def slow_once(message: Message) -> None:
        if message.id == slow_id and not slowed.is_set():
            slowed.set()
            time.sleep(5)  # longer than consumer_timeout: the broker closes the channel

    consumer = make_consumer(queue, db.prefix, node.url, batch_size=20, before_write=slow_once)()
    admin = RabbitAdmin(node.url)
    admin.declare(consumer)
    ids = [f"m-{n:04d}" for n in range(200)]
    admin.publish(queue, ids)

    worker = ThreadedWorker(consumer, db.engine)
    with worker, Readiness(worker.metrics.snapshot) as readiness:
        wait_for(
            lambda: len(order_counts(db.engine, db.orders)) == 200 and admin.depth(queue) == 0,
            60,
            "every message processed after the channel was closed",
        )
        wait_for(lambda: node.queue_messages(queue) == 0, 30, "every message acked")
        assert snapshot_ready(worker.metrics.snapshot()), "ready again once reattached"
        metrics = worker.finish()

    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == ids and set(counts.values()) == {1}, "each effect exactly once"
    assert metrics.channel_reopens >= 1, "the closed channel was noticed and reopened"
    assert readiness.seen_not_ready, "not ready while no consumer was attached"
    assert slow_id in consumer.duplicate_ids or metrics.duplicates >= 1
    admin.close()


def _poison(message: Message) -> None:
    if message.id is not None and message.id.startswith("poison"):
        raise ValueError("cannot parse order")


@pytest.mark.slow
def test_memory_alarm_acks_continue_dead_letters_wait_relay_pauses_without_leaks(
    db: Database, node: PrivateRabbitMQ
) -> None:
    queue = f"alarm-{uuid.uuid4().hex[:8]}"
    confirm_timeout = 2.0
    consumer = make_consumer(
        queue,
        db.prefix,
        node.url,
        batch_size=50,
        # back off at most 1 s while the dead letters cannot go out: they follow the
        # alarm's end within about a second
        retry_policy=replace(FAST_RETRY, infrastructure_backoff_max=1.0),
        before_write=_poison,
        connection_name=f"worker-{queue}",
    )()
    admin = RabbitAdmin(node.url)
    admin.declare(consumer)
    # one poison per batch: each waits out the blocked dead-letter publish (~1 s)
    ids = [f"poison-{n}" if n % 50 == 7 else f"m-{n:04d}" for n in range(500)]
    admin.publish(queue, ids)
    good = sorted(i for i in ids if not i.startswith("poison"))
    poisons = sorted(set(ids) - set(good))
    # Outbox rows for the relay, written before the alarm.
    with Session(db.engine) as session, session.begin():
        writer = OutboxWriter(session, prefix=db.prefix)
        relay_ids = [
            writer.publish({"n": n}, exchange="", routing_key=f"{queue}.out") for n in range(200)
        ]
    admin.channel().queue_declare(f"{queue}.out", durable=True)
    admin.close()

    node.memory_alarm(True)
    started = time.monotonic()
    try:
        with ThreadedWorker(consumer, db.engine) as worker:
            # Every good message committed AND acked while publishers are blocked; only
            # the poisons (their dead letters cannot be published) stay in the queue.
            wait_for(
                lambda: (
                    len(order_counts(db.engine, db.orders)) == len(good)
                    and node.queue_messages(queue) == len(poisons)
                ),
                60,
                "acks to go on during the alarm",
            )
            assert worker.metrics.dead_lettered == 0
            assert worker.metrics.consumer_attached is True
            print(f"good messages acked during the alarm after {time.monotonic() - started:.1f} s")

            relay = Relay(
                db.engine,
                {
                    "rabbitmq": RabbitMQPublisher(
                        node.url, confirm_timeout=confirm_timeout, connect_timeout=2.0
                    )
                },
                prefix=db.prefix,
                config=RelayConfig(broker_backoff_max=1.0, poll_interval=0.2, batch_size=50),
            )
            store = OutboxStore(db.prefix)
            with relay_thread(relay):
                deadline = time.monotonic() + 3 * confirm_timeout  # several confirm timeouts
                while time.monotonic() < deadline:
                    status = store.status(db.engine)
                    assert status.failed == 0, "an alarm must not fail rows"
                    assert len(node.connections("mqdedup-relay")) <= 1, (
                        "the relay left a blocked connection behind"
                    )
                    time.sleep(0.5)  # observing the paused relay
                assert store.status(db.engine).published == 0
                node.memory_alarm(False)
                cleared = time.monotonic()
                wait_for(
                    lambda: store.status(db.engine).published == 200, 60, "the relay to resume"
                )
                assert len(node.connections("mqdedup-relay")) == 1
                print(f"relay resumed {time.monotonic() - cleared:.1f} s after the alarm")
            wait_for(
                lambda: (
                    node.queue_messages(f"{queue}.dlq") >= len(poisons)
                    and node.queue_messages(queue) == 0
                ),
                60,
                "the poisons dead-lettered once the alarm is over",
            )
            print(f"poisons dead-lettered {time.monotonic() - cleared:.1f} s after the alarm")
            worker.finish()
    finally:
        node.memory_alarm(False)

    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == good and set(counts.values()) == {1}
    assert store.status(db.engine).failed == 0
    channel = pika.BlockingConnection(pika.URLParameters(node.url)).channel()
    delivered = set()
    while True:
        method, properties, _ = channel.basic_get(f"{queue}.out", auto_ack=True)
        if method is None:
            break
        delivered.add(properties.message_id)
    assert delivered == set(relay_ids), "every relayed row arrived"


def test_dead_letter_queue_that_refuses_raises_dead_letter_refused_promptly(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    consumer = make_consumer(
        queue,
        db.prefix,
        rabbitmq_url,
        batch_size=20,
        dead_letter_queue_arguments={"x-max-length": 5, "x-overflow": "reject-publish"},
    )()
    broker.declare(consumer)
    broker.publish(queue, [f"p-{n}" for n in range(8)])
    transport = consumer.create_transport()
    try:
        deliveries: list[Any] = []
        wait_for(
            lambda: deliveries.extend(transport.fetch(20, 0.5)) or len(deliveries) == 8,
            30,
            "8 deliveries",
        )
        record = DeadLetter(reason="handler failed: ValueError: bad", consumer=queue, attempts=3)
        for delivery in deliveries[:5]:
            transport.dead_letter(delivery, record)
        started = time.monotonic()
        with pytest.raises(DeadLetterRefusedError, match="refused"):
            transport.dead_letter(deliveries[5], record)
        assert time.monotonic() - started < 2.0, "refused promptly, not after a timeout"
        transport.settle(deliveries[:5])
        assert transport.connected, "a refused dead letter does not cost the consumer"
    finally:
        transport.close()
    wait_for(lambda: broker.depth(f"{queue}.dlq") == 5, 10, "5 dead letters")


def test_dlq_refusing_by_policy_handler_runs_at_most_max_attempts_good_messages_flow(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    runs: dict[str, int] = {}

    def poison(message: Message) -> None:
        assert message.id is not None
        if message.id.startswith("poison"):
            runs[message.id] = runs.get(message.id, 0) + 1
            raise ValueError("cannot parse order")

    consumer = make_consumer(
        queue,
        db.prefix,
        rabbitmq_url,
        batch_size=100,
        retry_policy=RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02),
        before_write=poison,
        dead_letter_queue_arguments={"x-max-length": 5, "x-overflow": "reject-publish"},
    )()
    broker.declare(consumer)
    ids = [f"poison-{n}" if n % 100 == 3 else f"m-{n:05d}" for n in range(2_000)]
    broker.publish(queue, ids)
    good = [i for i in ids if not i.startswith("poison")]
    with ThreadedWorker(consumer, db.engine) as worker:
        wait_for(
            lambda: (
                len(order_counts(db.engine, db.orders)) == len(good) and broker.depth(queue) == 0
            ),
            60,
            "good messages flow while the DLQ refuses",
        )
        time.sleep(1)  # let redeliveries of the poisons happen, if any would
        metrics = worker.finish()
    assert max(runs.values()) <= 3, runs
    assert metrics.dead_letters_parked + broker.depth(f"{queue}.dlq") == 20


def test_topology_mismatch_after_a_reconnect_is_one_clear_error_and_exit_code_3(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, rabbitmqctl: list[str]
) -> None:
    consumer = make_consumer(queue, db.prefix, rabbitmq_url, batch_size=50)()
    broker.declare(consumer)
    broker.publish(queue, [f"a-{n}" for n in range(20)])
    env = {
        **os.environ,
        "MQDEDUP_TEST_RABBIT_QUEUE": queue,
        "MQDEDUP_TEST_RABBIT_PREFIX": db.prefix,
        "PYTHONPATH": str(REPO),
    }
    command = [
        str(Path(sys.executable).parent / "mqdedup"),
        "worker",
        "tests.integration.rabbitmq.cli_consumer:CliOrders",
        "--database",
        db.url,
        "--table-prefix",
        db.prefix,
        "--rabbitmq-url",
        rabbitmq_url,
    ]
    worker = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(
            lambda: worker.poll() is not None or len(order_counts(db.engine, db.orders)) == 20,
            60,
            "the worker to consume",
        )
        assert worker.poll() is None
        # Someone re-creates the dead-letter queue with other arguments...
        channel = broker.channel()
        channel.queue_delete(f"{queue}.dlq")
        channel.queue_declare(f"{queue}.dlq", durable=True, arguments={"x-max-length": 10})
        # ...and the worker's connection drops: the reconnect declares the topology again.
        closed = _close_connections(rabbitmqctl, f"mqdedup:{queue}:")
        assert closed >= 1
        started = time.monotonic()
        stdout, stderr = worker.communicate(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    output = stdout + stderr
    assert worker.returncode == exitcodes.CONFIGURATION, output[-3000:]
    assert "inequivalent arg" in output, output[-3000:]
    assert output.count("retrying") <= 1, "no reconnect loop on a configuration error"
    assert elapsed < 30
    broker.delete(f"{queue}.dlq")


def _close_connections(ctl: list[str], name_part: str) -> int:
    pids = pids_matching(ctl, name_part)
    for pid in pids:
        rabbitmqctl(ctl, "close_connection", pid, "test: reconnect")
    return len(pids)
