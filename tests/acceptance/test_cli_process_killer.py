"""A message whose handler kills its process, through ``mqdedup worker`` on real brokers.

Message ``m-10`` of 200 calls ``os._exit(1)``. The supervisor restarts the worker; the
redelivered message runs in careful mode (its attempt committed before the handler
runs), so after ``max_attempts`` deaths it is dead-lettered alone with the reason "the
worker died while handling it", the other 199 are processed once, the queue / lag
drains to 0 and the restarts stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.consumers.processor import WORKER_DIED
from tests.acceptance.killer_consumers import MAX_ATTEMPTS
from tests.integration.kafka.helpers import row_counts
from tests.integration.rabbitmq.support import make_consumer
from tests.services import (
    KAFKA_SESSION_TIMEOUT_ENV,
    REPO,
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    free_port,
    kill_session_timeout_ms,
    prefixed_database,
    table_prefix,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
COUNT = 200
KILLER = "m-10"


@pytest.fixture
def database(pg_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    prefix = table_prefix()
    orders = orders_table(prefix)
    runs = tmp_path / "killer-runs"
    env = {
        **os.environ,
        "KILLER_PREFIX": prefix,
        "KILLER_ID": KILLER,
        "KILLER_RUNS_FILE": str(runs),
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_TABLE_PREFIX": prefix,
        "PYTHONPATH": str(REPO),
    }
    with prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as db:
        yield {"prefix": prefix, "engine": db.engine, "env": env, "runs": runs}


def healthz(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return dict(json.load(reply))
    except OSError:
        return {}


def killer_runs(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


class Supervised:
    """``mqdedup worker <consumer> --processes 1`` with a health port."""

    def __init__(self, consumer: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [
                MQDEDUP,
                "worker",
                consumer,
                "--processes",
                "1",
                "--health-port",
                str(self.port),
                "--shutdown-timeout",
                "30",
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def restarts(self) -> int:
        return int(healthz(self.port).get("restarts", -1))

    def assert_restarts_stopped(self, expected: int, settle: float = 3.0) -> None:
        """The restart count is ``expected`` and stays so (the loop is over)."""
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            state = healthz(self.port)
            assert state.get("restarts") == expected, state
            assert state.get("running") == 1, state
            time.sleep(0.2)

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, err = self.process.communicate(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.communicate()
        return err


def assert_others_processed_once(engine: Engine, prefix: str) -> None:
    counts = row_counts(engine, prefix)
    assert KILLER not in counts
    assert len(counts) == COUNT - 1 and set(counts.values()) == {1}


def test_kafka_process_killer_is_dead_lettered_alone(
    kafka: KafkaHelper, database: dict[str, Any]
) -> None:
    engine: Engine = database["engine"]
    topic = kafka.create_topic(partitions=1, kind="killer")
    group = f"group-{topic}"
    kafka.produce(topic, [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in range(COUNT)])
    env = {
        **database["env"],
        "KILLER_TOPIC": topic,
        "KILLER_GROUP": group,
        # each restart waits for the group to drop the dead worker: sooner where allowed
        KAFKA_SESSION_TIMEOUT_ENV: str(kill_session_timeout_ms(kafka.bootstrap)),
    }
    worker = Supervised("tests.acceptance.killer_consumers:KafkaKiller", env)
    try:
        wait_for(
            lambda: (
                worker.process.poll() is not None or kafka.committed(group, topic) == {0: COUNT}
            ),
            90,
            "the partition's committed offset to reach its end (lag 0)",
        )
        assert worker.process.poll() is None, worker.stop()[-3000:]
        assert_others_processed_once(engine, database["prefix"])
        # The first death happened in an ordinary batch (nobody had consumed the
        # partition before); every later run was counted before it started.
        assert killer_runs(database["runs"]) == MAX_ATTEMPTS + 1
        worker.assert_restarts_stopped(MAX_ATTEMPTS + 1)
        dead = kafka.read_all(f"{topic}.DLT", expected=1)
    finally:
        err = worker.stop()
    assert worker.process.returncode == exitcodes.OK, err[-3000:]
    assert len(dead) == 1
    headers = {name: value.decode() for name, value in dead[0].headers}
    assert headers["message-id"] == KILLER
    assert headers["x-mqdedup-reason"] == WORKER_DIED
    assert headers["x-mqdedup-attempts"] == str(MAX_ATTEMPTS)
    assert dead[0].value == b'{"n": 10}'


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_rabbitmq_process_killer_is_dead_lettered_alone(
    rabbitmq_url: str, database: dict[str, Any], queue_type: str
) -> None:
    engine: Engine = database["engine"]
    queue = f"killer-{uuid.uuid4().hex[:8]}"
    dead_letter_queue = f"{queue}.dlq"
    admin = RabbitAdmin(rabbitmq_url)
    admin.declare(make_consumer(queue, database["prefix"], rabbitmq_url, queue_type=queue_type)())
    env = {
        **database["env"],
        "KILLER_QUEUE": queue,
        "KILLER_QUEUE_TYPE": queue_type,
        "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
    }
    worker: Supervised | None = None
    try:
        admin.publish(
            queue,
            [f"m-{n}" for n in range(COUNT)],
            body=lambda message_id: json.dumps({"id": message_id}).encode(),
        )
        worker = Supervised("tests.acceptance.killer_consumers:RabbitKiller", env)
        running = worker
        wait_for(
            lambda: (
                running.process.poll() is not None
                or (
                    admin.depth(dead_letter_queue) == 1
                    and len(row_counts(engine, database["prefix"])) == COUNT - 1
                )
            ),
            90,
            "the killer in the DLQ and every other message processed",
        )
        assert worker.process.poll() is None, worker.stop()[-3000:]
        wait_for(lambda: admin.depth(queue) == 0, 30, "the queue to drain")
        assert_others_processed_once(engine, database["prefix"])
        # The first death happened in an ordinary batch (a first delivery); every later
        # run came back redelivered and was counted before it started.
        assert killer_runs(database["runs"]) == MAX_ATTEMPTS + 1
        worker.assert_restarts_stopped(MAX_ATTEMPTS + 1)
        dead = admin.peek_all(dead_letter_queue)
    finally:
        err = worker.stop() if worker is not None else ""
        admin.delete(queue, dead_letter_queue)
        admin.close()
    assert worker.process.returncode == exitcodes.OK, err[-3000:]
    assert len(dead) == 1
    properties, body = dead[0]
    assert properties.message_id == KILLER
    assert properties.headers["x-mqdedup-reason"] == WORKER_DIED
    assert str(properties.headers["x-mqdedup-attempts"]) == str(MAX_ATTEMPTS)
    assert json.loads(body) == {"id": KILLER}
