"""A FastStream producer's messages, consumed once by a mqdedup consumer, under kill -9.

FastStream publishers send no ``message-id``: only ``content-type`` and a
``correlation_id`` (a Kafka header; on RabbitMQ the AMQP property). A mqdedup consumer
with ``ids.from_correlation_id()`` and a typed (dataclass) body consumes them from real
Kafka and RabbitMQ into PostgreSQL. Its first worker process is killed with SIGKILL
after its first transaction committed and before the broker was settled (offset
commit / ack); a second worker gets those messages again and skips them as
duplicates. Every order has exactly one row, also the ones FastStream published twice
with the same correlation id.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.faststream_worker import consumer_class
from tests.integration.kafka.helpers import row_counts
from tests.services import (
    REPO,
    KafkaHelper,
    RabbitAdmin,
    TestDatabase,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.integration]

ORDERS = 30
RESENT = range(0, ORDERS, 6)  # published a second time with the same correlation id


def correlation(number: int) -> str:
    return f"fs-order-{number}"


async def publish_with_faststream(spec: dict[str, Any]) -> None:
    """What a team's existing FastStream service does, plus a resend of some orders."""
    numbers = [*range(ORDERS), *RESENT]
    if spec["broker"] == "kafka":
        from faststream.kafka import KafkaBroker

        async with KafkaBroker(spec["bootstrap"]) as kafka_broker:
            for number in numbers:
                await kafka_broker.publish(
                    {"order": number, "amount": number * 10},
                    topic=spec["topic"],
                    correlation_id=correlation(number),
                )
    else:
        from faststream.rabbit import RabbitBroker

        async with RabbitBroker(spec["url"]) as rabbit_broker:
            for number in numbers:
                await rabbit_broker.publish(
                    {"order": number, "amount": number * 10},
                    queue=spec["queue"],
                    correlation_id=correlation(number),
                )


class Worker:
    def __init__(self, spec: dict[str, Any], database_url: str, log: Path) -> None:
        self._log = log.open("ab")
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.faststream_worker"],
            cwd=REPO,
            env={
                **os.environ,
                "FS_SPEC": json.dumps(spec),
                "MQDEDUP_TEST_DATABASE_URL": database_url,
                "PYTHONPATH": str(REPO),
            },
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def alive(self) -> bool:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"worker exited with {self.process.returncode}:\n{tail}")
        return True

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)
            self._log.close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop(signal.SIGKILL)


@pytest.mark.parametrize("broker", ["kafka", "rabbitmq"])
def test_faststream_messages_are_processed_once_across_a_kill_between_commit_and_settle(
    broker: str,
    db: TestDatabase,
    pg_url: str,
    tmp_path: Path,
    workers: list[Worker],
    request: pytest.FixtureRequest,
) -> None:
    spec: dict[str, Any] = {
        "broker": broker,
        "prefix": db.prefix,
        "hold_file": str(tmp_path / "held"),
    }
    if broker == "kafka":
        kafka_helper: KafkaHelper = request.getfixturevalue("kafka_helper")
        spec.update(
            topic=kafka_helper.create_topic(partitions=1, kind="faststream"),
            group=unique_name("fs-group"),
            bootstrap=kafka_helper.bootstrap,
        )
    else:
        rabbit: RabbitAdmin = request.getfixturevalue("rabbit")
        spec.update(queue=unique_name("faststream"), url=rabbit.url)
        rabbit.declare(consumer_class(spec)())  # the queue the producer publishes to
        rabbit.created.append(spec["queue"])
    asyncio.run(publish_with_faststream(spec))

    first = Worker(spec, pg_url, tmp_path / "first.log")
    workers.append(first)
    held = Path(spec["hold_file"])
    wait_for(lambda: first.alive() and held.exists(), 90, "the first commit")
    committed = set(row_counts(db.engine, db.prefix))
    assert 0 < len(committed) < ORDERS  # committed, and the broker not yet settled
    first.stop(signal.SIGKILL)  # kill -9 between commit and settle

    duplicates = tmp_path / "second-duplicates"
    second_spec = {**spec, "hold_file": None, "duplicates_file": str(duplicates)}
    second = Worker(second_spec, pg_url, tmp_path / "second.log")
    workers.append(second)
    wait_for(
        lambda: second.alive() and len(row_counts(db.engine, db.prefix)) >= ORDERS,
        90,
        f"{ORDERS} orders",
    )
    # the committed-but-unsettled messages came again and were skipped
    wait_for(
        lambda: committed <= set(duplicates.read_text().split()) if duplicates.exists() else False,
        30,
        "the redelivered messages skipped as duplicates",
    )
    second.stop()

    counts = row_counts(db.engine, db.prefix)
    assert counts == {correlation(number): 1 for number in range(ORDERS)}  # effects once
    skipped = set(duplicates.read_text().split())
    assert committed <= skipped <= set(counts)  # the killed batch came again: skipped
