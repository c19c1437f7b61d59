"""The claim as a library call under kill -9, against the real brokers (issue 43).

Three consumers that are not mqdedup consumers: the FastStream subscriber of
``examples/faststream_claim`` (on Kafka and on RabbitMQ), the hand-written kafka-python
loop of ``examples/kafka_loop_claim`` and the Celery task (``acks_late``) of
``examples/celery_claim`` (RabbitMQ; the task id is the message id). Each claims with
``mqdedup.claim`` / ``async_claim`` in its own transaction and acks after the commit.

Each test: 20 payments plus 5 producer resends on the broker; the consumer process
kills itself with SIGKILL right after ``pay-7``'s transaction commits and before its
ack (``CLAIM_CRASH_AFTER_COMMIT``); it is restarted. Asserted in PostgreSQL: ``pay-7``'s
row was committed before the kill (the crash struck between commit and ack), the
restarted process got ``pay-7`` again and skipped it as a duplicate carrying the
stored result, and in the end every payment has exactly one row and one claim.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Column, Engine, MetaData, String, Table, func, select

from mqdedup.db.schema import schema
from tests.services import (
    REPO,
    checked_engine,
    kill_session_timeout_ms,
    service_env,
    wait_for,
)

pytestmark = pytest.mark.integration

PAYMENTS = 20
RESENT = 5
CRASH_ID = "pay-7"
TIMEOUT = 120.0


@dataclass
class Run:
    """One test's names, environment and database."""

    env: dict[str, str]
    engine: Engine
    business_prefix: str
    mqdedup_prefix: str
    consumer: str
    logs: Path

    def module(self, name: str, log: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``python -m <name>`` with this run's environment (output to ``log``)."""
        output = (self.logs / log).open("wb") if log else subprocess.DEVNULL
        return subprocess.Popen(
            [sys.executable, "-m", name],
            cwd=REPO,
            env=self.env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )

    def call(self, name: str) -> None:
        result = subprocess.run(
            [sys.executable, "-m", name],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert result.returncode == 0, f"{name}: {result.stdout!r} {result.stderr!r}"

    def rows(self) -> dict[str, int]:
        """Payment rows per message id."""
        table = Table(
            f"{self.business_prefix}claim_payments",
            MetaData(),
            Column("message_id", String(255)),
        )
        with self.engine.connect() as connection:
            found = connection.execute(
                select(table.c.message_id, func.count()).group_by(table.c.message_id)
            ).all()
        return {row[0]: int(row[1]) for row in found}

    def claims(self) -> dict[str, object]:
        """The consumer's claims with their stored results."""
        processed = schema(self.mqdedup_prefix).processed
        with self.engine.connect() as connection:
            found = connection.execute(
                select(processed.c.message_id, processed.c.result).where(
                    processed.c.consumer_name == self.consumer
                )
            ).all()
        return {row[0]: row[1] for row in found}


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    url = service_env("MQDEDUP_TEST_DATABASE_URL", "PostgreSQL")
    bootstrap = service_env("MQDEDUP_KAFKA_BOOTSTRAP", "Kafka")
    rabbit = service_env("MQDEDUP_RABBITMQ_URL", "RabbitMQ")
    tag = uuid.uuid4().hex[:10]
    names = f"claim-{tag}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "MQDEDUP_DATABASE_URL": url,
        "MQDEDUP_KAFKA_BOOTSTRAP": bootstrap,
        "MQDEDUP_RABBITMQ_URL": rabbit,
        "EXAMPLE_TABLE_PREFIX": f"c{tag}_",
        "MQDEDUP_TABLE_PREFIX": f"c{tag}_mq_",
        "CLAIM_TOPIC": names,
        "CLAIM_QUEUE": names,
        "CLAIM_GROUP": names,
        "CLAIM_CONSUMER": names,
        "CLAIM_KAFKA_SESSION_TIMEOUT_MS": str(kill_session_timeout_ms(bootstrap)),
    }
    env.pop("CLAIM_CRASH_AFTER_COMMIT", None)
    engine = checked_engine(url, "PostgreSQL")
    state = Run(env, engine, f"c{tag}_", f"c{tag}_mq_", names, tmp_path)
    try:
        yield state
    finally:
        with engine.begin() as connection:
            connection.exec_driver_sql(f'DROP TABLE IF EXISTS "c{tag}_claim_payments"')
        schema(f"c{tag}_mq_").metadata.drop_all(engine)
        engine.dispose()
        _delete_broker_names(bootstrap, rabbit, names)


def _delete_broker_names(bootstrap: str, rabbit: str, name: str) -> None:
    import kafka
    import pika

    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        if name in admin.list_topics():
            admin.delete_topics([name])
    finally:
        admin.close()
    connection = pika.BlockingConnection(pika.URLParameters(rabbit))
    try:
        channel = connection.channel()
        channel.queue_delete(name)
        channel.exchange_delete(name)  # Celery's default exchange for its queue
    finally:
        connection.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.mark.parametrize(
    ("module", "producer", "broker"),
    [
        ("examples.faststream_claim.app", "examples.faststream_claim.produce", "kafka"),
        ("examples.faststream_claim.app", "examples.faststream_claim.produce", "rabbit"),
        ("examples.kafka_loop_claim.loop", "examples.faststream_claim.produce", "kafka"),
        ("examples.celery_claim.worker", "examples.celery_claim.produce", "rabbit"),
    ],
    ids=["faststream-kafka", "faststream-rabbitmq", "kafka-python-loop", "celery-acks-late"],
)
def test_kill_9_between_commit_and_ack_leaves_every_effect_once(
    run: Run, module: str, producer: str, broker: str
) -> None:
    run.env["CLAIM_BROKER"] = broker
    run.call("examples.faststream_claim.setup")
    run.call(producer)

    # First life: dies by SIGKILL right after pay-7's commit, before its ack.
    run.env["CLAIM_CRASH_AFTER_COMMIT"] = CRASH_ID
    first = run.module(module, "first.log")
    try:
        first.wait(timeout=TIMEOUT)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
    first_log = (run.logs / "first.log").read_text(errors="replace")
    assert first.returncode == -signal.SIGKILL, first_log[-3000:]
    assert run.rows().get(CRASH_ID) == 1, "pay-7 must have committed before the kill"
    assert run.claims()[CRASH_ID] == {"charged": 17}

    # Second life: gets pay-7 again (never acked), finds the claim, finishes the rest.
    del run.env["CLAIM_CRASH_AFTER_COMMIT"]
    second = run.module(module, "second.log")

    def done() -> bool:
        assert second.poll() is None, (run.logs / "second.log").read_text()[-3000:]
        log = (run.logs / "second.log").read_text(errors="replace")
        return len(run.rows()) == PAYMENTS and f"duplicate {CRASH_ID}: first run stored" in log

    try:
        wait_for(done, TIMEOUT, "the restarted consumer to finish every payment")
    finally:
        _stop(second)
    second_log = (run.logs / "second.log").read_text(errors="replace")
    assert f"duplicate {CRASH_ID}: first run stored {{'charged': 17}}" in second_log
    assert f"processed {CRASH_ID}" not in second_log

    expected = {f"pay-{n}" for n in range(PAYMENTS)}
    assert run.rows() == dict.fromkeys(expected, 1)  # every effect exactly once
    claims = run.claims()
    assert set(claims) == expected
    assert all(claims[f"pay-{n}"] == {"charged": 10 + n} for n in range(PAYMENTS))
    assert second.returncode == 0, second_log[-3000:]  # SIGTERM: a clean stop
