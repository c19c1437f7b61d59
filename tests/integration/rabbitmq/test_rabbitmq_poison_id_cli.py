"""Issue 12, item 1 end to end: a producer's NUL-byte message id through ``mqdedup worker``.

Before the per-message boundary the child crashed on PostgreSQL's ``DataError`` and
was restarted again and again, the queue stuck behind the poison message. Now the
poison is dead-lettered with its reason, the others are processed, no child restarts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import (
    REPO,
    BrokerAdmin,
    make_consumer,
    order_counts,
    wait_for,
)

pytestmark = pytest.mark.integration

GOOD = ["good-1", "good-2", "good-3", "good-4"]


def test_worker_cli_dead_letters_a_nul_message_id_and_processes_the_others(
    db: Database, broker: BrokerAdmin, queue: str, rabbit_url: str
) -> None:
    broker.declare(make_consumer(queue, db.prefix, rabbit_url, batch_size=50)())
    broker.publish(queue, [GOOD[0], GOOD[1], "bad\x00id", "", GOOD[2], GOOD[3]])
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
        rabbit_url,
        "--processes",
        "1",
    ]
    worker = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(
            lambda: (
                worker.poll() is not None
                or (
                    len(order_counts(db.engine, db.orders)) == len(GOOD)
                    and broker.depth(f"{queue}.dlq") == 2
                    and broker.depth(queue) == 0
                )
            ),
            60,
            "the good messages processed and the poison dead-lettered",
        )
        assert worker.poll() is None, worker.communicate()[1][-3000:]
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, stderr[-3000:]
    assert "child died" not in stderr, "a child crashed and was restarted"
    assert order_counts(db.engine, db.orders) == dict.fromkeys(GOOD, 1)
    dead = broker.peek_all(f"{queue}.dlq")
    reasons = {props.message_id: props.headers["x-mqdedup-reason"] for props, _ in dead}
    assert reasons == {
        "bad\x00id": "message id contains a NUL byte (AMQP message_id property)",
        "": "missing message id: empty AMQP message_id property",
    }
