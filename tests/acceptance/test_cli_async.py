"""Async consumers through the real operations: ``mqdedup worker`` and killed workers.

* ``mqdedup worker`` runs an ``AsyncConsumer`` (Kafka, 30% duplicates) on one event
  loop per process: every message once, healthy on ``/healthz``, counted on
  ``/metrics``, offsets committed to the end, and SIGTERM drains it with exit code 0.
* Worker processes of the test kit (the same ``consumer.run(engine)`` as ``mqdedup
  worker``) are killed with ``kill -9`` after their commit and before the RabbitMQ ack,
  three times, and once mid-batch; a rerun drains the queue: each effect once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, select

from mqdedup.cli import exitcodes
from mqdedup.db.schema import schema
from mqdedup.testing import assert_effectively_once
from mqdedup.testing.brokers import RabbitMQHarness
from tests.acceptance.async_consumers import AsyncRabbitOrders
from tests.integration.kafka.helpers import row_counts
from tests.services import (
    REPO,
    KafkaHelper,
    Outgoing,
    TestDatabase,
    free_port,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
COUNT = 150


def get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return dict(json.load(reply))
    except OSError:
        return {}


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def outbox_rows(db: TestDatabase) -> int:
    with db.engine.connect() as connection:
        table = schema(db.prefix).outbox
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def test_mqdedup_worker_runs_an_async_consumer_and_drains_on_sigterm(
    kafka_helper: KafkaHelper, db: TestDatabase, pg_url: str
) -> None:
    topic = kafka_helper.create_topic(partitions=3, kind="async")
    group = f"group-{topic}"
    messages = [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in range(COUNT)]
    copies = messages[::3]  # a retrying producer sends a third of them twice
    kafka_helper.produce(topic, messages + copies)
    port = free_port()
    env = {
        **os.environ,
        "ASYNC_TOPIC": topic,
        "ASYNC_GROUP": group,
        "ASYNC_PREFIX": db.prefix,
        "MQDEDUP_DATABASE_URL": pg_url,
        "PYTHONPATH": str(REPO),
    }
    command = [MQDEDUP, "worker", "tests.acceptance.async_consumers:AsyncKafkaOrders"]
    worker = subprocess.Popen(
        [*command, "--processes", "1", "--health-port", str(port)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ends = kafka_helper.end_offsets(topic)
        wait_for(
            lambda: worker.poll() is not None or kafka_helper.committed(group, topic) == ends,
            90,
            "the group's committed offsets to reach the end of every partition",
        )
        assert worker.poll() is None, "the worker exited early"
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert health.get("ready") is True, health
        metrics = get_text(f"http://127.0.0.1:{port}/metrics")
        assert "mqdedup_messages_processed_total" in metrics, metrics[:2000]
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
        try:
            _, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    assert worker.returncode == exitcodes.OK, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert row_counts(db.engine, db.prefix) == {m.message_id: 1 for m in messages}
    assert outbox_rows(db) == COUNT

    # A replay of the whole topic runs the async handler through the range transport:
    # only the ids whose claims were purged (with the relayed outbox) are applied again.
    forgotten = [f"m-{n}" for n in range(0, COUNT, 10)]
    tables = schema(db.prefix)
    with db.engine.begin() as connection:
        connection.execute(delete(tables.outbox))
        connection.execute(
            delete(tables.processed).where(tables.processed.c.message_id.in_(forgotten))
        )
    replay = subprocess.run(
        [MQDEDUP, "replay", command[2], "--from", "beginning"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert replay.returncode == exitcodes.OK, replay.stderr[-3000:]
    assert re.search(rf"new \(processed now\)\s+{len(forgotten)}\n", replay.stdout), (
        replay.stdout + replay.stderr[-4000:]
    )
    counts = row_counts(db.engine, db.prefix)
    assert {k for k, v in counts.items() if v == 2} == set(forgotten)  # only the forgotten
    assert outbox_rows(db) == len(forgotten)
    assert kafka_helper.committed(group, topic) == ends  # the live group's offsets untouched


def test_async_workers_killed_after_commit_before_ack_apply_each_effect_once(
    mqdedup_rabbitmq_harness: Callable[..., RabbitMQHarness], pg_url: str
) -> None:
    harness = mqdedup_rabbitmq_harness(AsyncRabbitOrders, database_url=pg_url)
    orders = orders_table(harness.prefix)
    orders.create(harness.engine)
    try:
        for n in range(60):
            harness.publish({"n": n}, message_id=f"order-{n}")
        harness.deliver_each_twice()

        assert harness.run_killing_after_commit(times=3) == 3
        assert harness.run_killing_mid_batch(after_messages=4)
        harness.run_until_drained()

        assert harness.kills == 4
        assert_effectively_once(row_counts(harness.engine, harness.prefix), harness.ids)
        with harness.engine.connect() as connection:
            outbox = schema(harness.prefix).outbox
            events = connection.execute(select(func.count()).select_from(outbox)).scalar_one()
        assert events == 60  # deterministic outgoing ids: a rerun rewrote none twice
    finally:
        orders.drop(harness.engine, checkfirst=True)
