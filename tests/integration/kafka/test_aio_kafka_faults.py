"""The aiokafka transport under faults, against the real Kafka and PostgreSQL.

``AsyncKafkaConsumer`` workers (``async def handle`` writing through the
``AsyncSession``) run as processes of the test kit (``mqdedup.testing.brokers``: the same
``consumer.run(engine)`` as ``mqdedup worker``, one event loop per process):

* 30% duplicates, three workers killed with ``kill -9`` after their commit and before
  the offset commit, a poison message: a rerun drains the topic, each effect once, the
  poison message in the dead-letter topic with its reason;
* a rebalance: a second worker joins while the first holds a committed batch whose
  offsets are not committed: each effect once;
* a dead letter the broker refuses (too large for the DLT) is kept in the database with
  the broker's reason, and its batch-mates go on;
* the database stops for 20 s, over three poll deadlines: the worker waits, the group
  keeps it, nothing is dead-lettered, then each effect once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import insert, make_url

from mqdedup import AsyncContext, Message, Metrics, RetryPolicy, StopToken, create_async_engine
from mqdedup.kafka import AsyncKafkaConsumer
from mqdedup.testing.brokers import KafkaHarness
from tests.integration.asyncio.proxy import CuttableProxy
from tests.integration.kafka.consumers import FAST_GROUP
from tests.integration.kafka.helpers import row_counts, run_until_parked
from tests.services import (
    KafkaHelper,
    Outgoing,
    TestDatabase,
    kafka_headers,
    unique_name,
    wait_for_on_loop,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration]

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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_aiokafka_dead_letter_refused_by_the_broker_is_kept_in_the_database(
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
        "AioKafkaRefused",
        (AioKafkaOrders,),
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


@pytest.mark.slow
def test_aiokafka_database_stopped_20s_keeps_the_member_and_loses_nothing(
    kafka_helper: KafkaHelper, db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """The database 'stops' for 20 s (a proxy on the worker's loop is cut), over three times
    ``max_poll_interval_ms`` and longer than the session timeout: the worker waits, the
    poll task keeps the member in the group (no rebalance), nothing is dead-lettered;
    afterwards each effect once."""
    max_poll_interval_ms = 6000
    outage = 20.0  # over three poll deadlines and three session timeouts
    topic = kafka_helper.create_topic(partitions=2)
    ids = [f"o-{n:03d}" for n in range(400)]
    kafka_helper.produce(topic, [Outgoing(i, b"{}") for i in ids])
    group = unique_name("group")
    consumer = type(
        "AioKafkaOutage",
        (AioKafkaOrders,),
        {
            "topics": (topic,),
            "group_id": group,
            "bootstrap_servers": kafka_helper.bootstrap,
            "table_prefix": db.prefix,
            "batch_size": 20,
            "poll_timeout": 0.2,
            "kafka_config": {**FAST_GROUP, "max_poll_interval_ms": max_poll_interval_ms},
            # resume within a second of the database being back
            "retry_policy": RetryPolicy(
                max_attempts=2,
                initial_backoff=0.01,
                max_backoff=0.02,
                infrastructure_backoff_max=1.0,
            ),
        },
    )()
    target = make_url(db.url)
    stop = StopToken()
    metrics = Metrics()
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        proxy = CuttableProxy(target.host or "127.0.0.1", target.port or 5432)
        await proxy.open()
        engine = create_async_engine(target.set(host="127.0.0.1", port=proxy.listen_port))
        task = asyncio.create_task(consumer.run_async(engine, stop=stop, metrics=metrics))
        try:
            await wait_for_on_loop(lambda: metrics.processed >= 60, 60, "the worker to get going")
            await proxy.cut()
            caplog.clear()
            await asyncio.sleep(outage)  # over three times the poll deadline
            assert not task.done(), "the worker gave up during the outage"
            seen["outage"] = metrics.outage
            seen["revoked"] = [r for r in caplog.records if "partitions revoked" in r.message]
            await proxy.open()  # the database is back
            await wait_for_on_loop(lambda: metrics.processed >= len(ids), 60, "every message")
        finally:
            stop.request()
            await asyncio.wait_for(task, 60)
            await engine.dispose()
            await proxy.cut()

    with caplog.at_level(logging.INFO, logger="mqdedup.kafka.aio_transport"):
        asyncio.run(scenario())

    assert str(seen["outage"]).startswith("database unavailable"), seen
    assert seen["revoked"] == [], "the group dropped the member during the outage"
    assert metrics.dead_lettered == 0
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(ids, 1)
    assert kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic)
