"""RabbitMQ faults: the broker closing connections, kill -9, long handlers, signals."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pika
import pika.exceptions
import pytest

from mqdedup import Message
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import (
    ThreadedWorker,
    WorkerProcess,
    close_connections,
    connection_heartbeat,
    connection_pids,
    make_consumer,
    order_counts,
    with_duplicates,
)
from tests.services import RabbitAdmin, wait_for

pytestmark = pytest.mark.integration


def test_broker_closing_the_connection_mid_batch_5_times_loses_nothing_doubles_nothing(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, rabbitmqctl: list[str]
) -> None:
    ids = with_duplicates(5_000, 0.1, seed=3)
    unique = sorted(set(ids))
    triggers = [unique[position] for position in (400, 1_300, 2_200, 3_100, 4_000)]
    in_handler = {trigger: threading.Event() for trigger in triggers}
    release = {trigger: threading.Event() for trigger in triggers}

    def hold_mid_batch(message: Message) -> None:
        # The first time a trigger is handled, its batch is in flight: hold it there.
        if message.id in in_handler and not in_handler[message.id].is_set():
            in_handler[message.id].set()
            if not release[message.id].wait(60):
                raise TimeoutError("test never released the batch")

    consumer = make_consumer(
        queue,
        db.prefix,
        rabbitmq_url,
        batch_size=100,
        reconnect_backoff_max=1.0,
        before_write=hold_mid_batch,
    )()
    broker.declare(consumer)
    broker.publish(queue, ids)
    name = consumer.connection_name
    assert name is not None

    with ThreadedWorker(consumer, db.engine) as worker:
        for number, trigger in enumerate(triggers, start=1):
            assert in_handler[trigger].wait(60), f"batch with {trigger} never started"
            generation = worker.transport.generation
            assert close_connections(rabbitmqctl, name, f"mqdedup test close {number}") == 1
            # The I/O thread sees the close and reconnects (a new generation) while the
            # handler still holds the batch whose deliveries died with the old channel.
            wait_for(
                lambda g=generation: worker.transport.generation > g and worker.transport.connected,
                60,
                f"reconnect #{number}",
            )
            release[trigger].set()  # the batch commits; its acks are dropped, not sent
        wait_for(
            lambda: (
                len(order_counts(db.engine, db.orders)) == len(unique) and broker.depth(queue) == 0
            ),
            120,
            "every order written and the queue drained",
        )
        metrics = worker.finish()

    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == unique, "nothing lost"
    assert set(counts.values()) == {1}, "nothing applied twice"
    assert worker.transport.reconnects == 5
    # The 5 held batches committed but could not be acked: they came back as duplicates.
    assert set(triggers) <= set(consumer.duplicate_ids)
    assert metrics.processed == len(unique)
    assert metrics.dead_lettered == 0
    assert broker.depth(queue) == 0 and broker.depth(f"{queue}.dlq") == 0


def test_kill_9_after_commit_before_ack_redelivers_as_a_duplicate(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    ids = [f"k{number:04d}" for number in range(400)]
    config = {
        "queue": queue,
        "prefix": db.prefix,
        "url": rabbitmq_url,
        "database_url": db.url,
        "batch_size": 25,
    }
    consumer = make_consumer(queue, db.prefix, rabbitmq_url, batch_size=25)()
    broker.declare(consumer)
    broker.publish(queue, ids)

    victim = WorkerProcess.start({**config, "kill_after_commit": "k0210"})
    code, report = victim.wait(timeout=120)
    assert code == -signal.SIGKILL, victim.stderr[-2000:]
    assert report == {}, "killed before it could report"
    committed_by_victim = set(order_counts(db.engine, db.orders))
    assert "k0210" in committed_by_victim, "it had committed"
    assert broker.depth(queue) > 0

    survivor = WorkerProcess.start(config)
    try:
        wait_for(
            lambda: len(order_counts(db.engine, db.orders)) == 400 and broker.depth(queue) == 0,
            120,
            "the second worker to finish",
        )
        survivor.process.send_signal(signal.SIGTERM)
        code, report = survivor.wait(timeout=60)
    finally:
        survivor.kill()
    assert code == 0, survivor.stderr[-2000:]
    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == ids and set(counts.values()) == {1}
    assert "k0210" in report["duplicates"], "the redelivered message was skipped"
    # Only the killed batch (committed, never acked) came back, and was skipped.
    assert set(report["duplicates"]) <= committed_by_victim
    assert 1 <= report["metrics"]["duplicates"] == len(report["duplicates"]) <= 25
    assert report["metrics"]["processed"] == 400 - len(committed_by_victim)
    assert broker.depth(queue) == 0


def test_handler_longer_than_twice_the_heartbeat_keeps_the_connection(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, rabbitmqctl: list[str]
) -> None:
    """An 8 s handler at a 2 s heartbeat (the broker drops a peer after two missed): a pika
    connection left alone that long is dropped by the broker (the control connection
    below proves it on this broker); ours is not."""
    heartbeat = 2
    handler_seconds = 4.0 * heartbeat
    separator = "&" if "?" in rabbitmq_url else "?"
    url = f"{rabbitmq_url}{separator}heartbeat={heartbeat}"

    def slow(message: Message) -> None:
        if message.id == "slow":
            time.sleep(handler_seconds)  # the behaviour under test: a long handler

    consumer = make_consumer(queue, db.prefix, url, batch_size=10, before_write=slow)()
    broker.declare(consumer)
    control = pika.BlockingConnection(pika.URLParameters(url))  # never serviced below
    with ThreadedWorker(consumer, db.engine) as worker:
        name = consumer.connection_name
        assert name is not None
        assert connection_heartbeat(rabbitmqctl, name) == [heartbeat]
        pids_before = connection_pids(rabbitmqctl, name)
        broker.publish(queue, ["before", "slow", "after"], wait=False)
        wait_for(
            lambda: len(order_counts(db.engine, db.orders)) == 3 and broker.depth(queue) == 0,
            60,
            "the three messages",
        )
        assert connection_pids(rabbitmqctl, name) == pids_before, "same connection"
        metrics = worker.finish()

    with pytest.raises(pika.exceptions.AMQPConnectionError):
        control.channel()  # the broker dropped the unserviced control connection
    assert order_counts(db.engine, db.orders) == {"before": 1, "slow": 1, "after": 1}
    assert worker.transport.generation == 1 and worker.transport.reconnects == 0
    assert (metrics.processed, metrics.duplicates) == (3, 0), "acked once, never redelivered"
    assert consumer.calls["slow"] == 1
    assert broker.depth(queue) == 0


def test_sigterm_finishes_and_acks_the_batch_in_flight_then_a_second_signal_stops_at_once(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, tmp_path: Path
) -> None:
    ids = [f"g{number:04d}" for number in range(200)]
    base = {
        "queue": queue,
        "prefix": db.prefix,
        "url": rabbitmq_url,
        "database_url": db.url,
        "batch_size": 20,
    }
    consumer = make_consumer(queue, db.prefix, rabbitmq_url, batch_size=20)()
    broker.declare(consumer)
    broker.publish(queue, ids)

    # 1. One SIGTERM in the middle of a batch: the batch completes, is acked, exit 0.
    marker = tmp_path / "in-batch"
    graceful = WorkerProcess.start(
        {**base, "slow_id": "g0050", "slow_seconds": 2.0, "marker": str(marker)}
    )
    try:
        wait_for(marker.exists, 60, "the worker to be in the batch with g0050")
        graceful.process.send_signal(signal.SIGTERM)
        code, report = graceful.wait(timeout=60)
    finally:
        graceful.kill()
    assert code == 0, graceful.stderr[-2000:]
    done = order_counts(db.engine, db.orders)
    assert "g0050" in done and set(done.values()) == {1}
    assert report["metrics"]["processed"] == len(done)
    assert broker.depth(queue) == len(ids) - len(done), "the rest is back in the queue"

    # 2. SIGTERM twice while a handler works: the process stops without finishing it.
    marker2 = tmp_path / "in-batch-2"
    slow_id = sorted(set(ids) - set(done))[30]
    impatient = WorkerProcess.start(
        {**base, "slow_id": slow_id, "slow_seconds": 60.0, "marker": str(marker2)}
    )
    try:
        wait_for(marker2.exists, 60, f"the worker to be in the batch with {slow_id}")
        started = time.monotonic()
        impatient.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # two separate signals, not one coalesced delivery
        impatient.process.send_signal(signal.SIGTERM)
        code, _ = impatient.wait(timeout=30)
    finally:
        impatient.kill()
    assert code == 130, impatient.stderr[-2000:]
    assert time.monotonic() - started < 20, "did not wait for the 60 s handler"
    assert slow_id not in order_counts(db.engine, db.orders), "its batch rolled back"

    # 3. A fresh worker: everything exactly once; the acked batch of step 1 never came back.
    fresh = make_consumer(queue, db.prefix, rabbitmq_url, batch_size=20)()
    with ThreadedWorker(fresh, db.engine) as worker:
        wait_for(
            lambda: (
                len(order_counts(db.engine, db.orders)) == len(ids) and broker.depth(queue) == 0
            ),
            60,
            "all orders",
        )
        worker.finish()
    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == ids and set(counts.values()) == {1}
    assert not set(fresh.duplicate_ids) & set(done), "step 1's batch was acked, not redelivered"
