"""A message id no database can store never stops ``mqdedup worker`` (issue: NUL ids).

Through the real CLI on real Kafka / RabbitMQ and PostgreSQL: a message whose id holds a
NUL byte, among good ones, is dead-lettered with its reason; the good ones are processed
once; the worker process is never restarted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from sqlalchemy import Engine

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from tests.acceptance.test_cli_operations import MQDEDUP, health_answer
from tests.integration.kafka.helpers import row_counts
from tests.services import REPO, KafkaHelper, Outgoing, free_port, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration]

GOOD = [f"m-{n}" for n in range(4)]
POISON_ID = "bad\x00id"


@pytest.fixture
def tables(pg_url: str) -> Iterator[tuple[Engine, str]]:
    prefix = f"acc_{uuid.uuid4().hex[:8]}_"
    engine = create_engine(pg_url)
    init_schema(engine, prefix)
    orders_table(prefix).create(engine)
    yield engine, prefix
    orders_table(prefix).drop(engine, checkfirst=True)
    schema(prefix).metadata.drop_all(engine)
    engine.dispose()


def _run_worker(consumer: str, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [MQDEDUP, "worker", consumer, "--processes", "1", "--health-port", str(port)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(worker: subprocess.Popen[str]) -> tuple[int, str]:
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    return worker.returncode, stderr


def _env(pg_url: str, prefix: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "ACCEPT_PREFIX": prefix,
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_TABLE_PREFIX": prefix,
        "PYTHONPATH": str(REPO),
        **extra,
    }


def test_kafka_worker_dead_letters_a_nul_id_and_keeps_going(
    kafka: KafkaHelper,
    tables: tuple[Engine, str],
    pg_url: str,
) -> None:
    engine, prefix = tables
    topic = kafka.create_topic(partitions=1, kind="poison-id")
    ids = [GOOD[0], GOOD[1], POISON_ID, GOOD[2], GOOD[3]]
    kafka.produce(topic, [Outgoing(message_id, b"{}") for message_id in ids])
    env = _env(pg_url, prefix, ACCEPT_TOPIC=topic, ACCEPT_GROUP=f"group-{topic}")
    port = free_port()
    worker = _run_worker("tests.acceptance.cli_consumers:Orders", env, port)
    try:
        wait_for(lambda: row_counts(engine, prefix) == dict.fromkeys(GOOD, 1), 90, "good rows")
        dead = kafka.read_all(f"{topic}.DLT", expected=1)
        assert len(dead) == 1
        headers = {name: value.decode() for name, value in dead[0].headers}
        assert "NUL" in headers["x-mqdedup-reason"], headers
        wait_for(lambda: kafka.committed(f"group-{topic}", topic) == {0: 5}, 30, "offsets")
        assert health_answer(port)["restarts"] == 0
    finally:
        code, stderr = _stop(worker)
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_rabbitmq_worker_dead_letters_a_nul_id_and_keeps_going(
    tables: tuple[Engine, str], pg_url: str, rabbitmq_url: str
) -> None:
    url = rabbitmq_url  # skips locally, fails in CI when RabbitMQ is missing
    engine, prefix = tables
    queue = f"poison-id-{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(queue=queue, durable=True)
    try:
        for message_id in [GOOD[0], GOOD[1], POISON_ID, GOOD[2], GOOD[3]]:
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=b"{}",
                properties=pika.BasicProperties(message_id=message_id, delivery_mode=2),
            )
        env = _env(pg_url, prefix, ACCEPT_QUEUE=queue, MQDEDUP_RABBITMQ_URL=url)
        port = free_port()
        worker = _run_worker("tests.acceptance.poison_consumers:QueueOrders", env, port)
        try:
            wait_for(lambda: row_counts(engine, prefix) == dict.fromkeys(GOOD, 1), 90, "good rows")

            def dead_letters() -> list[Any]:
                method, properties, _body = channel.basic_get(f"{queue}.dlq", auto_ack=True)
                return [properties] if method is not None else []

            found: list[Any] = []
            wait_for(lambda: bool(found.extend(dead_letters()) or found), 30, "the dead letter")
            assert "NUL" in found[0].headers["x-mqdedup-reason"], found[0].headers
            wait_for(
                lambda: channel.queue_declare(queue=queue, passive=True).method.message_count == 0,
                30,
                "an empty queue",
            )
            assert health_answer(port)["restarts"] == 0
        finally:
            code, stderr = _stop(worker)
        assert code == 0, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
    finally:
        channel.queue_delete(queue=queue)
        channel.queue_delete(queue=f"{queue}.dlq")
        connection.close()
