"""The foundation's promises against a real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from mqdedup import InMemoryBroker, Message, RetryPolicy, create_engine, run_until_idle
from mqdedup.consumers.worker import Worker
from mqdedup.errors import SimulatedCrash
from mqdedup.stopping import StopToken
from tests.services import REPO, PrivateService, free_port, require_service, wait_for
from tests.support import BulkOrderConsumer, OrderConsumer, order_counts, reset_database

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05)


class Orders(OrderConsumer):
    batch_size = 500
    retry_policy = FAST_RETRY


def publish_orders(broker: InMemoryBroker, count: int, prefix: str = "m") -> None:
    for number in range(count):
        broker.publish(
            "orders", json.dumps({"order": number, "amount": 1}), message_id=f"{prefix}{number}"
        )


@pytest.mark.parametrize("consumer_class", [Orders, BulkOrderConsumer])
def test_4k_deliveries_with_30pct_duplicates_write_each_order_once(
    pg_engine: Engine, consumer_class: type[OrderConsumer]
) -> None:
    broker = InMemoryBroker(seed=11)
    publish_orders(broker, 4_000)
    copies = broker.inject_duplicates("orders", 0.3)
    assert 1_000 < copies < 1_400

    metrics = run_until_idle(consumer_class(), broker.transport("orders"), pg_engine)

    counts = order_counts(pg_engine)
    assert len(counts) == 4_000 and set(counts.values()) == {1}
    assert (metrics.processed, metrics.duplicates) == (4_000, copies)


def test_two_processes_racing_on_one_message_id_write_one_row(
    pg_engine: Engine, pg_url: str, tmp_path: Path
) -> None:
    script = [sys.executable, "-m", "tests.integration.race_worker", pg_url]
    holder = subprocess.Popen(
        [*script, "holder", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    second = None
    try:
        wait_for((tmp_path / "entered").exists, 30, "the holder to claim and enter its handler")
        second = subprocess.Popen(
            [*script, "second", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )

        def second_waits_on_the_claim() -> bool:
            with pg_engine.connect() as connection:
                waiting = connection.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ).scalar()
            return bool(waiting)

        wait_for(second_waits_on_the_claim, 30, "the second worker to block on the holder's claim")
        assert second.poll() is None
        (tmp_path / "release").touch()
        holder_out, _ = holder.communicate(timeout=60)
        second_out, _ = second.communicate(timeout=60)
    finally:
        for process in (holder, second):
            if process is not None and process.poll() is None:
                process.kill()
    assert holder.returncode == 0 and second.returncode == 0
    holder_metrics, second_metrics = json.loads(holder_out), json.loads(second_out)
    assert (holder_metrics["processed"], holder_metrics["duplicates"]) == (1, 0)
    assert (second_metrics["processed"], second_metrics["duplicates"]) == (0, 1)
    assert order_counts(pg_engine) == {"race-1": 1}


def test_crash_after_commit_before_settle_is_not_applied_twice(pg_engine: Engine) -> None:
    crashes: list[int] = []

    class CrashingOrders(Orders):
        batch_size = 100

        def after_commit(self, messages: Sequence[Message]) -> None:
            if len(crashes) < 3:
                crashes.append(len(messages))
                raise SimulatedCrash("killed between commit and ack")

    broker = InMemoryBroker()
    publish_orders(broker, 1_000)
    redelivered = 0
    while broker.pending("orders"):
        worker = Worker(CrashingOrders(), broker.transport("orders"), pg_engine)
        try:
            worker.run(until_idle=True)
        except SimulatedCrash:
            redelivered += 100
    assert len(crashes) == 3 and redelivered == 300
    counts = order_counts(pg_engine)
    assert len(counts) == 1_000 and set(counts.values()) == {1}


def test_one_failing_handler_in_a_batch_of_100(pg_engine: Engine) -> None:
    class Failing(Orders):
        batch_size = 100
        fail_ids = frozenset({"m37"})

    broker = InMemoryBroker()
    publish_orders(broker, 100)
    metrics = run_until_idle(Failing(), broker.transport("orders"), pg_engine)

    counts = order_counts(pg_engine)
    assert len(counts) == 99 and "m37" not in counts
    [dead] = broker.dead_letters["orders"]
    assert dead.message.header("message-id") == "m37" and dead.record.attempts == 3
    assert "RuntimeError: cannot handle m37" in dead.record.reason
    with pg_engine.connect() as connection:
        claim = connection.execute(
            text("SELECT count(*) FROM mqdedup_processed_messages WHERE message_id = 'm37'")
        ).scalar()
    assert claim == 0
    assert (metrics.processed, metrics.retries, metrics.dead_lettered) == (99, 2, 1)


def test_missing_ids_and_undecodable_bodies_are_dead_lettered(pg_engine: Engine) -> None:
    broker = InMemoryBroker()
    publish_orders(broker, 50)
    broker.publish("orders", b'{"order": 1}')
    broker.publish("orders", b"\xff\xfe", message_id="binary")
    metrics = run_until_idle(Orders(), broker.transport("orders"), pg_engine)
    reasons = {d.record.reason.split(":")[0] for d in broker.dead_letters["orders"]}
    assert reasons == {"missing message id", "undecodable body"}
    assert metrics.delivered == 52 == metrics.processed + metrics.duplicates + metrics.dead_lettered
    assert len(order_counts(pg_engine)) == 50


@pytest.fixture
def private_postgres(tmp_path: Path) -> Iterator[tuple[PrivateService, str]]:
    port = free_port()
    service = PrivateService("postgres", tmp_path / "state", "PG_PORT", port)
    try:
        service.start()
    except RuntimeError as exc:
        require_service("a private PostgreSQL instance", str(exc))
    try:
        yield service, f"postgresql+psycopg://mqdedup:mqdedup@127.0.0.1:{port}/mqdedup"
    finally:
        service.stop()


@pytest.mark.slow
def test_database_down_mid_run_pauses_and_resumes_without_loss(
    private_postgres: tuple[PrivateService, str],
) -> None:
    service, url = private_postgres
    engine = create_engine(url)
    reset_database(engine)

    class Slow(Orders):
        batch_size = 50

    broker = InMemoryBroker()
    publish_orders(broker, 3_000)
    transport = broker.transport("orders")
    stop = StopToken()
    worker = Worker(Slow(), transport, engine, stop=stop)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: worker.metrics.processed >= 300, 60, "the worker to get going")
        service.stop()
        wait_for(
            lambda: worker.metrics.database_retries >= 3, 60, "the worker to notice the outage"
        )
        assert not broker.dead_letters  # an outage is never the message's fault
        outage = worker.metrics.outage  # /healthz: not ready, naming the cause
        assert outage is not None and outage.startswith("database unavailable")
        service.start()
        wait_for(
            lambda: broker.pending("orders") == 0 and transport.in_flight == 0,
            120,
            "the worker to finish after the database came back",
        )
        assert worker.metrics.outage is None  # ready again
    finally:
        stop.request()
        thread.join(timeout=30)
    assert not thread.is_alive()
    counts = order_counts(engine)
    assert len(counts) == 3_000 and set(counts.values()) == {1}
    assert not broker.dead_letters and worker.metrics.database_retries >= 3
    engine.dispose()
