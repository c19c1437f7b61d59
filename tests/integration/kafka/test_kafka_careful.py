"""Kafka careful mode: which records count as possibly redelivered after an assignment."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.schema import schema
from tests.integration.kafka.conftest import TestDatabase
from tests.integration.kafka.helpers import KafkaHelper, Outgoing, row_counts, wait_for
from tests.integration.kafka.test_kafka_consumer import consumer_for, running

pytestmark = pytest.mark.integration


def careful_ids(db: TestDatabase) -> set[str]:
    """Messages whose attempt was counted before their handler ran (careful mode)."""
    table = schema(db.prefix).attempts
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id).where(table.c.last_error == WORKER_DIED)
        )
        return {row[0] for row in rows}


def produce(kafka_helper: KafkaHelper, topic: str, numbers: range) -> None:
    kafka_helper.produce(topic, [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in numbers])


def test_a_graceful_stop_spares_the_next_owner_careful_mode(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    consumer = consumer_for(kafka_helper, db, topic, batch_size=20)  # window: 20 × 3
    group = consumer.group_id or ""
    produce(kafka_helper, topic, range(100))
    with running(consumer, db):
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 100}, 60, "offset 100")
    # A group that never committed may follow a worker that died before its first
    # commit: the first window of records is handled carefully.
    assert careful_ids(db) == {f"m-{n}" for n in range(60)}

    produce(kafka_helper, topic, range(100, 200))
    with running(consumer, db):
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 200}, 60, "offset 200")
    # The previous owner stopped gracefully: no care needed, no extra statement.
    assert careful_ids(db) == {f"m-{n}" for n in range(60)}
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 200 and set(counts.values()) == {1}
