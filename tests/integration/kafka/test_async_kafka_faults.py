"""AsyncKafkaConsumer (the kafka-python transport, driven from an event loop) under
faults, against the real Kafka and PostgreSQL.

``AsyncKafkaConsumer`` workers (``async def handle`` writing through the
``AsyncSession``) run as processes of the test kit (``mqdedup.testing.brokers``: the same
``consumer.run(engine)`` as ``mqdedup worker``, one event loop per process):

* 30% duplicates, three workers killed with ``kill -9`` after their commit and before
  the offset commit, a poison message: a rerun drains the topic, each effect once, the
  poison message in the dead-letter topic with its reason;
* a rebalance: a second worker joins while the first holds a committed batch whose
  offsets are not committed: each effect once (side by side with the kills);
* a dead letter the broker refuses (too large for the DLT) is kept in the database with
  the broker's reason, and its batch-mates go on;
* the database stopped for 20 s: ``tests/integration/asyncio/test_async_database_outage.py``
  (side by side with the async RabbitMQ worker's outage).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pytest
from sqlalchemy import insert

from mqdedup import AsyncContext, Message, RetryPolicy
from mqdedup.kafka import AsyncKafkaConsumer
from mqdedup.testing.brokers import KafkaHarness
from tests.integration.kafka.consumers import FAST_GROUP
from tests.integration.kafka.helpers import row_counts, run_until_parked
from tests.services import (
    KafkaHelper,
    Outgoing,
    TestDatabase,
    kafka_headers,
    unique_name,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration]

POISON = "poison-1"


class AsyncKafkaOrders(AsyncKafkaConsumer):
    """One order row per message through the AsyncSession; ``poison`` bodies fail."""

    __test__ = False
    topics = ("set-by-the-harness",)
    group_id = "set-by-the-harness"
    batch_size = 20
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02)

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        if message.json().get("poison"):
            raise ValueError(f"cannot handle {message.id}")
        await ctx.session.execute(
            insert(orders_table(self.table_prefix)).values(
                message_id=message.id, body=message.text()[:255]
            )
        )
        return None


def publish_with_duplicates(harness: KafkaHarness, count: int) -> list[str]:
    """``count`` orders, then 30% of them sent again (a retrying producer); their ids."""
    ids = [f"order-{n:04d}" for n in range(count)]
    for n, message_id in enumerate(ids):
        harness.publish({"n": n}, message_id=message_id)
    for message_id in random.Random(7).sample(ids, count * 3 // 10):
        harness.publish({"again": message_id}, message_id=message_id)
    return ids


def killed_after_commit_with_duplicates_and_a_poison_message(
    harness: KafkaHarness, kafka_helper: KafkaHelper
) -> None:
    ids = publish_with_duplicates(harness, 200)
    harness.publish({"poison": True}, message_id=POISON)

    assert harness.run_killing_after_commit(times=3) == 3
    harness.run_until_drained()

    assert row_counts(harness.engine, harness.prefix) == dict.fromkeys(ids, 1)
    [dead] = kafka_helper.read_all(f"{harness.topic}.DLT", 1, timeout=30)
    headers = kafka_headers(dead)
    assert headers["message-id"] == POISON
    assert headers["x-mqdedup-error-class"].endswith("ValueError")
    assert headers["x-mqdedup-attempts"] == "2"
    assert "cannot handle poison-1" in headers["x-mqdedup-error-message"]
    assert headers["x-mqdedup-source-topic"] == harness.topic
    assert dead.value == b'{"poison": true}'


def rebalance_while_a_committed_batch_is_unsettled(harness: KafkaHarness) -> None:
    ids = publish_with_duplicates(harness, 300)

    moved = harness.run_with_rebalance(batch_pause=0.05)
    assert moved["first"] > 0 and moved["second"] > 0, moved
    harness.run_until_drained()

    assert row_counts(harness.engine, harness.prefix) == dict.fromkeys(ids, 1)


@pytest.mark.slow
def test_async_kafka_workers_killed_after_commit_or_rebalanced_apply_each_once(
    mqdedup_kafka_harness: Callable[..., KafkaHarness], pg_url: str, kafka_helper: KafkaHelper
) -> None:
    """Two harness runs side by side (a thread each; own topic, group and tables): three
    workers killed after their commit with 30% duplicates and a poison message, and a
    rebalance while the first worker holds a committed batch whose offsets are not
    committed. Each asserts its own outcome; their worker starts and session timeouts
    overlap."""
    killed = mqdedup_kafka_harness(AsyncKafkaOrders, database_url=pg_url)
    rebalanced = mqdedup_kafka_harness(
        AsyncKafkaOrders, database_url=pg_url, attributes={"batch_size": 10}
    )
    tables = [orders_table(harness.prefix) for harness in (killed, rebalanced)]
    for table, harness in zip(tables, (killed, rebalanced), strict=True):
        table.create(harness.engine)
    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="async-kafka") as pool:
            runs = [
                pool.submit(
                    killed_after_commit_with_duplicates_and_a_poison_message, killed, kafka_helper
                ),
                pool.submit(rebalance_while_a_committed_batch_is_unsettled, rebalanced),
            ]
            wait(runs)
        for future in runs:
            future.result()
    finally:
        for table, harness in zip(tables, (killed, rebalanced), strict=True):
            table.drop(harness.engine, checkfirst=True)


def test_async_kafka_dead_letter_refused_by_the_broker_is_kept_in_the_database(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    """An oversized poison message the DLT refuses (``max.message.bytes``) is parked in
    the database with the broker's reason; the rest of its partition goes on."""
    topic = kafka_helper.create_topic(partitions=1)
    kafka_helper.admin.create_topics(
        {f"{topic}.DLT": {"num_partitions": 1, "configs": {"max.message.bytes": "1000"}}},
        wait_for_metadata=True,
    )
    good = [f"a-{n}" for n in range(30)]
    big = json.dumps({"poison": True, "pad": "x" * 5_000}).encode()
    kafka_helper.produce(
        topic,
        [Outgoing(i, b"{}") for i in good[:15]]
        + [Outgoing(POISON, big)]
        + [Outgoing(i, b"{}") for i in good[15:]],
    )
    consumer = type(
        "AsyncKafkaRefused",
        (AsyncKafkaOrders,),
        {
            "topics": (topic,),
            "group_id": unique_name("group"),
            "bootstrap_servers": kafka_helper.bootstrap,
            "table_prefix": db.prefix,
            "kafka_config": FAST_GROUP,
            "poll_timeout": 0.2,
        },
    )()
    kept, outcome = run_until_parked(consumer, db, good)
    assert kept.message.id == POISON and kept.message.body == big
    assert "TooLarge" in kept.refusal and f"{topic}.DLT" in kept.refusal
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(good, 1)
    assert outcome.dead_letters_parked == 1
