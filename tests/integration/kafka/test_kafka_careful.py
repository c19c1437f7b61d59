"""Kafka careful mode: which records count as possibly redelivered after an assignment."""

from __future__ import annotations

import kafka
import pytest
from kafka.structs import OffsetAndMetadata, TopicPartition
from sqlalchemy import select

from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.db.schema import schema
from tests.integration.kafka.helpers import row_counts
from tests.integration.kafka.test_kafka_consumer import consumer_for, running
from tests.services import KafkaHelper, Outgoing, TestDatabase, wait_for

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


def commit_as_a_crashed_owner(
    kafka_helper: KafkaHelper, group: str, topic: str, offset: int
) -> None:
    """The last periodic commit of a worker that then died (no clean-stop marker)."""
    client = kafka.KafkaConsumer(
        bootstrap_servers=kafka_helper.bootstrap, group_id=group, enable_auto_commit=False
    )
    try:
        client.commit({TopicPartition(topic, 0): OffsetAndMetadata(offset, "", -1)})
    finally:
        client.close()


def test_the_careful_window_follows_a_dead_owner_only(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    consumer = consumer_for(kafka_helper, db, topic, batch_size=20)  # window: 20 × 3
    group = consumer.group_id or ""
    produce(kafka_helper, topic, range(100))
    with running(consumer, db):
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 100}, 60, "offset 100")
    # Nobody consumed the partition before: nothing can have died on it.
    assert careful_ids(db) == set()

    produce(kafka_helper, topic, range(100, 200))
    commit_as_a_crashed_owner(kafka_helper, group, topic, 100)
    with running(consumer, db):
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 200}, 60, "offset 200")
    # The previous owner may have died handling the records after its last commit.
    assert careful_ids(db) == {f"m-{n}" for n in range(100, 160)}

    produce(kafka_helper, topic, range(200, 300))
    with running(consumer, db):
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 300}, 60, "offset 300")
    # The previous owner stopped gracefully: no care needed, no extra statement.
    assert careful_ids(db) == {f"m-{n}" for n in range(100, 160)}
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 300 and set(counts.values()) == {1}
