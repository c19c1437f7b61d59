"""``mqdedup worker`` runs RabbitMQ consumers in supervised processes: the production path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import make_consumer, order_counts, with_duplicates
from tests.services import REPO, RabbitAdmin, wait_for

pytestmark = pytest.mark.integration


def test_mqdedup_worker_cli_two_processes_on_one_queue_write_each_order_once(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    ids = with_duplicates(3_000, 0.3, seed=9)
    unique = sorted(set(ids))
    broker.declare(make_consumer(queue, db.prefix, rabbitmq_url, batch_size=50)())
    broker.publish(queue, ids)
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
        "--processes",
        "2",
    ]
    worker = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(
            lambda: (
                worker.poll() is not None
                or (
                    len(order_counts(db.engine, db.orders)) == len(unique)
                    and broker.depth(queue) == 0
                )
            ),
            120,
            "the CLI workers to drain the queue",
        )
        assert worker.poll() is None, worker.communicate()[1][-3000:]
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, stderr[-3000:]
    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == unique and set(counts.values()) == {1}
    assert broker.depth(queue) == 0 and broker.depth(f"{queue}.dlq") == 0
