"""A record the Kafka broker refuses fails alone (issue 18): the relay side, real Kafka.

kafka-python's idempotent producer goes fatal on one refused record and aborts every
other batch in flight with the same error; the relay must still publish and mark the
healthy rows, fail only the refused one, and never mark ``failed`` a row that is on
the topic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from mqdedup.cli import exitcodes
from mqdedup.kafka import KafkaPublisher
from mqdedup.outbox import OutboxStore, OutboxWriter, Relay, RelayConfig
from tests.integration.outbox.helpers import OutboxDb, poll_until
from tests.services import KafkaHelper, free_port, kafka_headers, unique_name

pytestmark = pytest.mark.integration

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")

#: The topic's limit: far above a batch of small rows (16 KB), far below the big row.
TOPIC_LIMIT = 50_000


def test_one_oversized_row_among_2000_fails_alone_and_the_other_1999_are_published(
    db: OutboxDb, kafka_helper: KafkaHelper, kafka_bootstrap: str
) -> None:
    topic = unique_name("limited")
    kafka_helper.admin.create_topics(
        {topic: {"num_partitions": 4, "configs": {"max.message.bytes": str(TOPIC_LIMIT)}}},
        wait_for_metadata=True,
    )
    kafka_helper.created.append(topic)
    with Session(db.engine) as session, session.begin():
        writer = OutboxWriter(session, prefix=db.prefix)
        ids = [
            writer.publish(
                b"x" * (3 * TOPIC_LIMIT) if n == 1_000 else b'{"n": %d}' % n,
                topic=topic,
                key=f"k{n % 50}",
            )
            for n in range(2_000)
        ]
    oversized = ids[1_000]
    publisher = KafkaPublisher(kafka_bootstrap)
    relay = Relay(
        db.engine,
        {"kafka": publisher},
        prefix=db.prefix,
        config=RelayConfig(max_attempts=3, initial_backoff=0.05, max_backoff=0.1),
    )
    try:
        relay.drain(timeout=90)
        poll_until(  # the refused row is retried after its backoff, then marked failed
            lambda: relay.drain(timeout=30) is not None and db.status().failed == 1,
            30,
            "the oversized row to fail after its attempts",
        )
    finally:
        relay.close()

    status = db.status()
    assert (status.published, status.failed, status.pending) == (1_999, 1, 0)
    table = OutboxStore(db.prefix).table
    with db.engine.connect() as connection:
        failed = connection.execute(
            select(table.c.message_id, table.c.last_error, table.c.attempts).where(
                table.c.state == "failed"
            )
        ).all()
    assert [(row.message_id, row.attempts) for row in failed] == [(oversized, 3)]
    assert "MessageSizeTooLargeError" in failed[0].last_error  # the broker's reason

    records = kafka_helper.read_all(topic, expected=1_999, timeout=60)
    on_topic = {kafka_headers(record)["message-id"] for record in records}
    assert on_topic == set(ids) - {oversized}  # nothing marked failed is on the topic
    assert publisher.replacements >= 1  # the fatal producer was replaced, not kept
    assert relay.metrics.failed == 1


def test_relay_cli_serves_kafka_rows_while_the_configured_rabbitmq_is_unreachable(
    db: OutboxDb, kafka_helper: KafkaHelper, kafka_bootstrap: str
) -> None:
    """Item 6: an unreachable RabbitMQ no longer makes ``mqdedup relay`` exit 6."""
    topic = kafka_helper.create_topic(partitions=2)
    with Session(db.engine) as session, session.begin():
        writer = OutboxWriter(session, prefix=db.prefix)
        ids = [writer.publish({"n": n}, topic=topic, key=f"k{n % 5}") for n in range(50)]
    env = {
        **os.environ,
        "MQDEDUP_DATABASE_URL": db.url,
        "MQDEDUP_TABLE_PREFIX": db.prefix,
        "MQDEDUP_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "MQDEDUP_RABBITMQ_URL": f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F",
    }
    relay = subprocess.Popen(
        [MQDEDUP, "relay"], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        poll_until(
            lambda: relay.poll() is not None or db.status().published == 50,
            60,
            "the Kafka rows published",
        )
        assert relay.poll() is None, relay.communicate()[1][-2000:]
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=60)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == exitcodes.OK, err[-2000:]
    assert "cannot reach RabbitMQ" in err and "relaying to kafka" in err  # said at start
    records = kafka_helper.read_all(topic, expected=50, timeout=30)
    assert {kafka_headers(r)["message-id"] for r in records} == set(ids)
