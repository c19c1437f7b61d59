"""Issue 12, item 1 end to end on Kafka: a NUL-byte ``message-id`` header through
``mqdedup worker``.

Before the per-message boundary the worker child crashed on PostgreSQL's ``DataError``
and was restarted again and again, never committing past the poison record. Now the
poison goes to ``<topic>.DLT`` with its reason, the others are processed, the offsets
move past it, and no child restarts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.kafka.conftest import TestDatabase
from tests.integration.kafka.helpers import (
    REPO,
    KafkaHelper,
    Outgoing,
    row_counts,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.integration

GOOD = ["good-1", "good-2", "good-3", "good-4"]


def test_worker_cli_dead_letters_a_nul_message_id_and_processes_the_others(
    db: TestDatabase, kafka_helper: KafkaHelper, kafka_bootstrap: str
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    group = unique_name("group")
    kafka_helper.produce(
        topic,
        [
            Outgoing(message_id=message_id, body=json.dumps({"id": number}).encode())
            for number, message_id in enumerate([GOOD[0], GOOD[1], "bad\x00id", GOOD[2], GOOD[3]])
        ],
    )
    spec = {
        "topic": topic,
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_bootstrap,
        "bulk": False,
        "batch_size": 50,
    }
    env = {**os.environ, "MQDEDUP_TEST_CONSUMER": json.dumps(spec), "PYTHONPATH": str(REPO)}
    command = [
        str(Path(sys.executable).parent / "mqdedup"),
        "worker",
        "tests.integration.kafka.cli_consumer:CliOrders",
        "--database",
        db.url,
        "--table-prefix",
        db.prefix,
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
                    len(row_counts(db.engine, db.prefix)) == len(GOOD)
                    and kafka_helper.committed(group, topic) == {0: 5}
                )
            ),
            90,
            "the good records processed and the offset past the poison",
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
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(GOOD, 1)
    (dead,) = kafka_helper.read_all(f"{topic}.DLT", expected=1)
    headers = dict(dead.headers)
    assert headers["message-id"] == b"bad\x00id"
    assert headers["x-mqdedup-reason"] == b"message id contains a NUL byte ('message-id' header)"
