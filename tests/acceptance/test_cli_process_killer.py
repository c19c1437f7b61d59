"""A message whose handler kills its process, through ``mqdedup worker`` on real brokers.

Message ``m-10`` of 200 calls ``os._exit(1)``. The supervisor restarts the worker; the
redelivered message runs in careful mode (its attempt committed before the handler
runs), so after ``max_attempts`` deaths it is dead-lettered alone with the reason "the
worker died while handling it", the other 199 are processed once, the queue / lag
drains to 0 and the restarts stop. Kafka, a RabbitMQ classic queue and a quorum queue
run side by side in one test, each with its own worker, tables and topic / queue.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
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
def databases(pg_url: str, tmp_path: Path) -> Iterator[Callable[[str], dict[str, Any]]]:
    """Fresh tables (orders and mqdedup's, under a prefix of their own) and a runs file
    per broker run; dropped at the end."""
    with contextlib.ExitStack() as stack:

        def make(label: str) -> dict[str, Any]:
            prefix = table_prefix()
            orders = orders_table(prefix)
            runs = tmp_path / f"{label}-killer-runs"
            env = {
                **os.environ,
                "KILLER_PREFIX": prefix,
                "KILLER_ID": KILLER,
                "KILLER_RUNS_FILE": str(runs),
                "MQDEDUP_DATABASE_URL": pg_url,
                "MQDEDUP_TABLE_PREFIX": prefix,
                "PYTHONPATH": str(REPO),
            }
            db = stack.enter_context(
                prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix)
            )
            return {"prefix": prefix, "engine": db.engine, "env": env, "runs": runs}

        yield make


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


def assert_restarts_stopped(workers: dict[str, Supervised], settle: float = 3.0) -> None:
    """Each worker's restart count is ``MAX_ATTEMPTS + 1`` and stays so (its loop is
    over); the workers are watched side by side, through one ``settle`` window.

    A poll the supervisor did not answer in time (a loaded machine) shows nothing about
    the restarts and is skipped; each supervisor must answer at least once."""
    answered = dict.fromkeys(workers, 0)
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline or not all(answered.values()):
        assert time.monotonic() < deadline + 30, f"unanswered health checks: {answered}"
        for name, worker in workers.items():
            state = healthz(worker.port)
            if not state:
                continue
            answered[name] += 1
            assert state.get("restarts") == MAX_ATTEMPTS + 1, (name, state)
            assert state.get("running") == 1, (name, state)
        time.sleep(0.2)


class KafkaRun:
    """The killer among ``COUNT`` messages on a one-partition topic, under ``mqdedup worker``."""

    def __init__(self, kafka: KafkaHelper, database: dict[str, Any]) -> None:
        self.kafka, self.database = kafka, database
        self.topic = kafka.create_topic(partitions=1, kind="killer")
        self.group = f"group-{self.topic}"
        kafka.produce(
            self.topic, [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in range(COUNT)]
        )
        env = {
            **database["env"],
            "KILLER_TOPIC": self.topic,
            "KILLER_GROUP": self.group,
            # each restart waits for the group to drop the dead worker: sooner where allowed
            KAFKA_SESSION_TIMEOUT_ENV: str(kill_session_timeout_ms(kafka.bootstrap)),
        }
        self.worker = Supervised("tests.acceptance.killer_consumers:KafkaKiller", env)

    def done(self) -> bool:
        """The worker exited (a failure) or the partition's committed offset reached its
        end (lag 0)."""
        return self.worker.process.poll() is not None or self.kafka.committed(
            self.group, self.topic
        ) == {0: COUNT}

    def dead_letters(self) -> list[tuple[str, bytes, dict[str, str]]]:
        """(message id, body, x-mqdedup headers) of each record on the dead-letter topic."""
        found = []
        for record in self.kafka.read_all(f"{self.topic}.DLT", expected=1):
            headers = {name: value.decode() for name, value in record.headers}
            found.append((headers["message-id"], record.value, headers))
        return found

    def cleanup(self) -> None:
        """Nothing beyond the kafka fixture's topics."""


class RabbitRun:
    """The killer among ``COUNT`` messages on a classic or quorum queue."""

    def __init__(self, rabbitmq_url: str, database: dict[str, Any], queue_type: str) -> None:
        self.database = database
        self.queue = f"killer-{uuid.uuid4().hex[:8]}"
        self.admin = RabbitAdmin(rabbitmq_url)
        self.admin.declare(
            make_consumer(self.queue, database["prefix"], rabbitmq_url, queue_type=queue_type)()
        )
        self.admin.publish(
            self.queue,
            [f"m-{n}" for n in range(COUNT)],
            body=lambda message_id: json.dumps({"id": message_id}).encode(),
        )
        env = {
            **database["env"],
            "KILLER_QUEUE": self.queue,
            "KILLER_QUEUE_TYPE": queue_type,
            "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
        }
        self.worker = Supervised("tests.acceptance.killer_consumers:RabbitKiller", env)

    def done(self) -> bool:
        """The worker exited (a failure) or the killer is in the DLQ and every other
        message processed, the queue drained."""
        return self.worker.process.poll() is not None or (
            self.admin.depth(f"{self.queue}.dlq") == 1
            and len(row_counts(self.database["engine"], self.database["prefix"])) == COUNT - 1
            and self.admin.depth(self.queue) == 0
        )

    def dead_letters(self) -> list[tuple[str, bytes, dict[str, str]]]:
        found = []
        for properties, body in self.admin.peek_all(f"{self.queue}.dlq"):
            headers = {name: str(value) for name, value in properties.headers.items()}
            found.append((properties.message_id, body, headers))
        return found

    def cleanup(self) -> None:
        self.admin.delete(self.queue, f"{self.queue}.dlq")
        self.admin.close()


def test_a_process_killing_message_is_dead_lettered_alone_on_kafka_and_rabbitmq(
    kafka: KafkaHelper, rabbitmq_url: str, databases: Callable[[str], dict[str, Any]]
) -> None:
    """Kafka, a RabbitMQ classic queue and a quorum queue (which counts deliveries
    itself), each with its own worker, tables and topic / queue, side by side: the
    restarts' back-offs and Kafka's session timeouts are waited out once, not three times."""
    runs: dict[str, KafkaRun | RabbitRun] = {}
    try:
        runs["kafka"] = KafkaRun(kafka, databases("kafka"))
        for queue_type in ("classic", "quorum"):
            runs[queue_type] = RabbitRun(rabbitmq_url, databases(queue_type), queue_type)
        for name, run in runs.items():
            wait_for(run.done, 90, f"{name}: the killer dead-lettered, the rest processed")
        for name, run in runs.items():
            assert run.worker.process.poll() is None, (name, run.worker.stop()[-3000:])
            assert_others_processed_once(run.database["engine"], run.database["prefix"])
            # The first death happened in an ordinary batch (nobody had consumed the
            # topic / queue before); every later run was counted before it started
            # (redelivered: careful mode).
            assert killer_runs(run.database["runs"]) == MAX_ATTEMPTS + 1, name
        assert_restarts_stopped({name: run.worker for name, run in runs.items()})
        dead = {name: run.dead_letters() for name, run in runs.items()}
    finally:
        errors = {name: run.worker.stop() for name, run in runs.items()}
        for run in runs.values():
            run.cleanup()
    for name, run in runs.items():
        assert run.worker.process.returncode == exitcodes.OK, (name, errors[name][-3000:])
        [(message_id, body, headers)] = dead[name]
        assert message_id == KILLER, name
        assert headers["x-mqdedup-reason"] == WORKER_DIED, name
        assert headers["x-mqdedup-attempts"] == str(MAX_ATTEMPTS), name
        expected = b'{"n": 10}' if name == "kafka" else json.dumps({"id": KILLER}).encode()
        assert body == expected, name
