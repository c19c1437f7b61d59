"""The examples in ``examples/`` run as their READMEs say, against the real services.

The README commands (setup, produce, ``mqdedup worker``, ``mqdedup relay``, report) run
as subprocesses with unique topic / queue names and table prefixes passed through the
environment variables the examples read, so parallel test runs do not collide.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, func, select, text

from examples.payments.produce import expected
from mqdedup.db import create_engine
from mqdedup.db.schema import schema
from tests.services import REPO, free_port, wait_for

pytestmark = [pytest.mark.integration]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
ORDERS = 300
INVALID_ORDERS = 2
PAYMENTS = 120


@pytest.fixture
def example_env(pg_url: str, kafka_bootstrap: str, rabbitmq_url: str) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_TABLE_PREFIX": f"ex_{tag}_",
        "EXAMPLE_TABLE_PREFIX": f"ex_{tag}_",
        "ORDERS_TOPIC": f"ex-orders-{tag}",
        "ORDER_EVENTS_TOPIC": f"ex-order-events-{tag}",
        "ORDERS_GROUP": f"ex-order-service-{tag}",
        "PAYMENTS_QUEUE": f"ex-payments-{tag}",
    }
    yield env
    _cleanup(env, pg_url)


def _cleanup(env: dict[str, str], pg_url: str) -> None:
    engine = create_engine(pg_url)
    prefix = env["EXAMPLE_TABLE_PREFIX"]
    metadata = MetaData()
    metadata.reflect(engine, only=lambda name, _: name.startswith(prefix))
    metadata.drop_all(engine)
    schema(env["MQDEDUP_TABLE_PREFIX"]).metadata.drop_all(engine)
    engine.dispose()
    import kafka
    import pika

    admin = kafka.KafkaAdminClient(bootstrap_servers=env["MQDEDUP_KAFKA_BOOTSTRAP"])
    try:
        topic = env["ORDERS_TOPIC"]
        doomed = [topic, f"{topic}.DLT", env["ORDER_EVENTS_TOPIC"]]
        admin.delete_topics([t for t in doomed if t in set(admin.list_topics())])
    finally:
        admin.close()
    connection = pika.BlockingConnection(pika.URLParameters(env["MQDEDUP_RABBITMQ_URL"]))
    try:
        channel = connection.channel()
        for queue in (env["PAYMENTS_QUEUE"], env["PAYMENTS_QUEUE"] + ".dlq"):
            channel.queue_delete(queue)
    finally:
        connection.close()


def run(*command: str, env: dict[str, str]) -> str:
    """Run one README command; fail with its output if it fails."""
    result = subprocess.run(
        [sys.executable, *command] if command[0] == "-m" else list(command),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def start(*command: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(
            [MQDEDUP, *command], env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT
        )


def stop(process: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM: a worker or relay drains and exits 0."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        raise AssertionError(f"{process.args!r} did not stop:\n{log.read_text()[-3000:]}") from None
    assert code == 0, f"{process.args!r} exited {code}:\n{log.read_text()[-3000:]}"


def settled_messages(port: int) -> int:
    """Deliveries a worker supervisor's children have finished (from ``/metrics``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    finished = 0
    for name in ("processed", "duplicates", "dead_lettered"):
        pattern = rf"^mqdedup_messages_{name}_total{{[^}}]*}} (\d+)"
        finished += sum(int(value) for value in re.findall(pattern, metrics, re.M))
    return finished


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=5):
            return True
    except OSError:
        return False


def _finished(port: int, sent: int) -> bool:
    return _ready(port) and settled_messages(port) >= sent


def scalar(engine: Engine, sql: str) -> Any:
    with engine.connect() as connection:
        return connection.execute(text(sql)).scalar_one()


def kafka_records(bootstrap: str, topic: str) -> list[Any]:
    """Every record of ``topic`` from the beginning to the current end."""
    import kafka

    consumer = kafka.KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partitions = [
            kafka.TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()
        ]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends = consumer.end_offsets(partitions)
        records: list[Any] = []
        deadline_polls = 200
        while any(consumer.position(tp) < ends[tp] for tp in partitions) and deadline_polls:
            deadline_polls -= 1
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def dead_letter_queue_depth(env: dict[str, str]) -> int:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(env["MQDEDUP_RABBITMQ_URL"]))
    try:
        declared = connection.channel().queue_declare(env["PAYMENTS_QUEUE"] + ".dlq", passive=True)
        return int(declared.method.message_count)
    finally:
        connection.close()


def test_order_service_and_payments_examples_run_end_to_end(
    example_env: dict[str, str], tmp_path: Path
) -> None:
    env = example_env
    want = expected(PAYMENTS)
    prefix = env["EXAMPLE_TABLE_PREFIX"]
    engine = create_engine(env["MQDEDUP_DATABASE_URL"])
    # README: setup, then the producers (30% / 20% resent with the same id, 20% of the
    # payment events resent by the "provider" with new ids).
    run("-m", "examples.order_service.setup", env=env)
    run("-m", "examples.payments.setup", env=env)
    produced = run(
        "-m",
        "examples.order_service.produce",
        "--orders",
        str(ORDERS),
        "--invalid",
        str(INVALID_ORDERS),
        env=env,
    )
    assert f"{ORDERS} orders, {int(ORDERS * 0.3)} duplicates" in produced
    sent_orders = int(produced.split()[1])
    produced = run("-m", "examples.payments.produce", "--payments", str(PAYMENTS), env=env)
    sent_payments = int(produced.split()[1])
    ports = {"orders": free_port(), "payments": free_port()}

    logs = {name: tmp_path / f"{name}.log" for name in ("orders", "relay", "payments")}
    processes = {
        "orders": start(
            "worker",
            "examples.order_service.consumer:OrderConsumer",
            "--health-port",
            str(ports["orders"]),
            env=env,
            log=logs["orders"],
        ),
        # Rows kept (not deleted once published): each event is matched to its row below.
        "relay": start(
            "relay", env={**env, "MQDEDUP_RELAY_KEEP_PUBLISHED": "1"}, log=logs["relay"]
        ),
        "payments": start(
            "worker",
            "examples.payments.consumer:PaymentConsumer",
            "--processes",
            "2",
            "--health-port",
            str(ports["payments"]),
            env=env,
            log=logs["payments"],
        ),
    }
    outbox = schema(env["MQDEDUP_TABLE_PREFIX"]).outbox.name
    try:
        # Every message sent, duplicates included, has been handled before we look.
        for name, sent in (("orders", sent_orders), ("payments", sent_payments)):
            wait_for(
                functools.partial(_finished, ports[name], sent),
                timeout=45,
                what=f"the {name} worker to finish all {sent} messages",
                interval=0.5,
            )
        wait_for(
            lambda: (
                scalar(engine, f"SELECT count(*) FROM {prefix}orders") >= ORDERS
                and scalar(engine, f"SELECT count(*) FROM {outbox} WHERE state = 'published'")
                >= ORDERS
            ),
            timeout=40,
            what="all orders written and their events published",
            interval=0.5,
        )
        wait_for(
            lambda: (
                scalar(engine, f"SELECT count(*) FROM {prefix}ledger")
                >= want["capture entries"] + want["refund entries"]
            ),
            timeout=30,
            what="the payments' ledger entries",
            interval=0.5,
        )
    finally:
        for name, process in processes.items():
            stop(process, logs[name])

    # Order service: each order exactly once, one published event per order with the
    # outbox row's message id, invalid orders dead-lettered.
    assert scalar(engine, f"SELECT count(*) FROM {prefix}orders") == ORDERS
    assert scalar(engine, f"SELECT count(DISTINCT order_id) FROM {prefix}orders") == ORDERS
    with engine.connect() as connection:
        table = schema(env["MQDEDUP_TABLE_PREFIX"]).outbox
        states: dict[str, int] = dict(
            connection.execute(select(table.c.state, func.count()).group_by(table.c.state)).all()
        )
        outbox_ids = set(connection.execute(select(table.c.message_id)).scalars())
    assert states == {"published": ORDERS}
    events = kafka_records(env["MQDEDUP_KAFKA_BOOTSTRAP"], env["ORDER_EVENTS_TOPIC"])
    event_ids = {dict(record.headers)["message-id"].decode() for record in events}
    assert event_ids == outbox_ids
    assert len({record.key for record in events}) == ORDERS
    dead = kafka_records(env["MQDEDUP_KAFKA_BOOTSTRAP"], env["ORDERS_TOPIC"] + ".DLT")
    assert sorted(record.key.decode() for record in dead) == [
        f"order-{n}" for n in range(ORDERS, ORDERS + INVALID_ORDERS)
    ]
    report = run("-m", "examples.order_service.report", env=env)
    assert "orders written more than once          0" in report

    # Payments: final statuses as planned, each capture / refund booked once although
    # 20% of the events came again with the same id and 20% with new ids; nothing
    # dead-lettered.
    with engine.connect() as connection:
        statuses: dict[str, int] = dict(
            connection.execute(
                text(f"SELECT status, count(*) FROM {prefix}payments GROUP BY status")
            ).all()
        )
        entries: dict[str, int] = dict(
            connection.execute(
                text(f"SELECT entry, count(*) FROM {prefix}ledger GROUP BY entry")
            ).all()
        )
        doubled = connection.execute(
            text(
                f"SELECT count(*) FROM (SELECT payment_id, entry FROM {prefix}ledger "
                "GROUP BY payment_id, entry HAVING count(*) > 1) d"
            )
        ).scalar_one()
    assert statuses == {k: want[k] for k in ("CAPTURED", "REFUNDED", "VOIDED")}
    assert entries == {"capture": want["capture entries"], "refund": want["refund entries"]}
    assert doubled == 0
    report = run("-m", "examples.payments.report", env=env)
    assert "already in target state" in report
    assert dead_letter_queue_depth(env) == 0
    engine.dispose()


def test_guide_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The first Python block of the tutorial (docs/tutorial/1-in-memory.md) runs
    unchanged and prints what it says."""
    guide = (REPO / "docs" / "tutorial" / "1-in-memory.md").read_text()
    block = guide.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(block)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    printed = "delivered 119, processed 100, duplicates 19, order rows 100"
    assert result.stdout.strip() == printed
    assert f"`{printed}`" in guide
