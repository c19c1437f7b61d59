"""A Kafka replay is a range transport run by the Worker and the shared Processor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mqdedup.consumers.transport import DeadLetter
from mqdedup.kafka.range import KafkaRangeTransport
from tests.integration.kafka.consumers import make_consumer
from tests.integration.kafka.helpers import row_counts
from tests.services import REPO, KafkaHelper, Outgoing, TestDatabase, unique_name, wait_for

pytestmark = pytest.mark.integration


def test_a_replay_dead_letters_the_failing_message_with_its_reason_and_processes_the_rest(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    ids = [f"rp-{i}" for i in range(30)]
    kafka_helper.produce(
        topic,
        [
            Outgoing(mid, f"body-{mid}".encode(), key=mid.encode(), partition=i % 2)
            for i, mid in enumerate(ids)
        ],
    )
    consumer = make_consumer(
        topic=topic,
        group=unique_name("group"),
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        batch_size=8,
        fail_ids=frozenset({"rp-13"}),
    )

    report = consumer().replay(db.engine)

    assert (report.new, report.duplicates, report.dead_lettered, report.unsettled) == (29, 0, 1, 0)
    assert row_counts(db.engine, db.prefix) == {mid: 1 for mid in ids if mid != "rp-13"}
    dead = kafka_helper.read_all(f"{topic}.DLT", expected=1)
    assert len(dead) == 1
    assert (dead[0].key, dead[0].value) == (b"rp-13", b"body-rp-13")
    headers = {name: value.decode() for name, value in dead[0].headers}
    assert headers["x-mqdedup-reason"] == (
        "handler failed after 3 attempts: ValueError: cannot handle rp-13"
    )
    assert headers["x-mqdedup-source-topic"] == topic

    again = consumer().replay(db.engine)  # the dead letter is not claimed: it fails again
    assert (again.new, again.duplicates, again.dead_lettered) == (0, 29, 1)
    assert len(kafka_helper.read_all(f"{topic}.DLT", expected=2)) == 2


def test_given_back_deliveries_are_fetched_again_before_the_rest_of_the_range(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    kafka_helper.produce(topic, [Outgoing(f"gb-{i}", b"x") for i in range(6)])
    consumer = make_consumer(
        topic=topic, group=unique_name("group"), prefix=db.prefix, bootstrap=kafka_helper.bootstrap
    )
    transport = KafkaRangeTransport(consumer().kafka_settings(), topics=[topic])
    try:
        first = transport.fetch(4, 1.0)
        assert [d.message.offset for d in first] == [0, 1, 2, 3]
        transport.settle(first[:2])
        transport.give_back(first[2:])
        again = transport.fetch(10, 1.0)
        assert [(d.message.offset, d.message.redelivered) for d in again] == [
            (2, True),
            (3, True),
        ]
        transport.dead_letter(again[0], DeadLetter("missing message id", "c", 1))
        transport.settle(again)
        rest = transport.fetch(10, 1.0)
        assert [d.message.offset for d in rest] == [4, 5]
        transport.settle(rest)
        assert transport.fetch(10, 1.0) == []  # the range is read
        ledger = transport.ledger
        assert (ledger.settled, ledger.without_id, ledger.unsettled) == (6, 1, 0)
    finally:
        transport.close()


def test_a_replay_killed_midway_and_run_again_applies_each_message_once(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    topic = kafka_helper.create_topic(partitions=3)
    ids = [f"k-{i}" for i in range(600)]
    kafka_helper.produce(topic, [Outgoing(mid, b"x", partition=i % 3) for i, mid in enumerate(ids)])
    hold = tmp_path / "held"
    spec: dict[str, Any] = {
        "topic": topic,
        "group": unique_name("group"),
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "batch_size": 50,
        "hold_file": str(hold),
        "hold_at": 4,
        "hold_for": 60.0,
    }
    script = (
        "import os\n"
        "from mqdedup.db import create_engine\n"
        "from tests.integration.kafka.consumers import consumer_from_env\n"
        "consumer_from_env()().replay(create_engine(os.environ['MQDEDUP_TEST_DATABASE_URL']))\n"
    )
    env = {
        **os.environ,
        "MQDEDUP_TEST_CONSUMER": json.dumps(spec),
        "MQDEDUP_TEST_DATABASE_URL": db.url,
        "PYTHONPATH": str(REPO),
    }
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env)
    try:
        wait_for(hold.exists, 60, "the replay to commit its fourth batch")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    done_before = sum(row_counts(db.engine, db.prefix).values())
    assert 0 < done_before < len(ids)

    consumer = make_consumer(**{**spec, "hold_file": None})
    report = consumer().replay(db.engine)

    assert (report.new, report.duplicates) == (len(ids) - done_before, done_before)
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(ids, 1)
