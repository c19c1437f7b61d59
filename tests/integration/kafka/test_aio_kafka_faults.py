"""The aiokafka transport under faults, against the real Kafka and PostgreSQL.

``AsyncKafkaConsumer`` workers (``async def handle`` writing through the
``AsyncSession``) run as processes of the test kit (``mqdedup.testing.brokers``: the same
``consumer.run(engine)`` as ``mqdedup worker``, one event loop per process):

* 30% duplicates, three workers killed with ``kill -9`` after their commit and before
  the offset commit, a poison message: a rerun drains the topic, each effect once, the
  poison message in the dead-letter topic with its reason;
* a rebalance: a second worker joins while the first holds a committed batch whose
  offsets are not committed: each effect once.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import insert

from mqdedup import AsyncContext, Message, RetryPolicy
from mqdedup.kafka import AsyncKafkaConsumer
from mqdedup.testing.brokers import KafkaHarness
from tests.integration.kafka.helpers import row_counts
from tests.services import KafkaHelper, kafka_headers
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POISON = "poison-1"


class AioKafkaOrders(AsyncKafkaConsumer):
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


def test_aiokafka_workers_killed_after_commit_with_duplicates_and_a_poison_message(
    mqdedup_kafka_harness: Callable[..., KafkaHarness], pg_url: str, kafka_helper: KafkaHelper
) -> None:
    harness = mqdedup_kafka_harness(AioKafkaOrders, database_url=pg_url)
    orders = orders_table(harness.prefix)
    orders.create(harness.engine)
    try:
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
    finally:
        orders.drop(harness.engine, checkfirst=True)


def test_aiokafka_rebalance_while_a_committed_batch_is_unsettled_applies_each_once(
    mqdedup_kafka_harness: Callable[..., KafkaHarness], pg_url: str
) -> None:
    harness = mqdedup_kafka_harness(
        AioKafkaOrders, database_url=pg_url, attributes={"batch_size": 10}
    )
    orders = orders_table(harness.prefix)
    orders.create(harness.engine)
    try:
        ids = publish_with_duplicates(harness, 300)

        moved = harness.run_with_rebalance(batch_pause=0.05)
        assert moved["first"] > 0 and moved["second"] > 0, moved
        harness.run_until_drained()

        assert row_counts(harness.engine, harness.prefix) == dict.fromkeys(ids, 1)
    finally:
        orders.drop(harness.engine, checkfirst=True)
