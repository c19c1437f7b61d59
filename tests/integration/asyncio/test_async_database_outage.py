"""The database stopped for 20 s under both async consumers, side by side on one loop.

An AsyncKafkaConsumer and an AsyncRabbitMQConsumer worker run on one event loop, each
with its own tables, topic / queue and database proxy. Each proxy is cut (the database
'stops' for that worker) once its worker got going, for 20 s (the issue's figure); the two
outages overlap, so the suite waits 20 s once, not twice. Each worker's outcome is
asserted on its own:

* Kafka: 20 s is over three times ``max_poll_interval_ms`` and longer than the session
  timeout: the worker waits, the transport's poll thread keeps the member in the group
  (no rebalance), nothing is dead-lettered; afterwards each effect once and the offsets
  at the end;
* RabbitMQ: 20 s is ten heartbeat intervals of a 2 s heartbeat, long enough for the broker
  to drop a connection whose heartbeats stopped: the worker waits with its batch
  unacked, reports the outage, dead-letters nothing, keeps its connection (nothing
  redelivered), then resumes: each effect once, queue drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import make_url

from mqdedup import Metrics, RetryPolicy, StopToken, create_async_engine
from tests.integration.asyncio.proxy import CuttableProxy
from tests.integration.kafka.consumers import FAST_GROUP
from tests.integration.kafka.helpers import row_counts
from tests.integration.kafka.test_async_kafka_faults import AsyncKafkaOrders
from tests.integration.rabbitmq.test_async_rabbitmq_faults import AsyncRabbitOrders, consumers
from tests.services import (
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    TestDatabase,
    prefixed_database,
    table_prefix,
    unique_name,
    wait_for,
    wait_for_on_loop,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OUTAGE = 20.0
#: Resume within a second of the database being back.
RETRY = RetryPolicy(
    max_attempts=2, initial_backoff=0.01, max_backoff=0.02, infrastructure_backoff_max=1.0
)
KAFKA_LOGGER = "mqdedup.kafka"
RABBIT_LOGGER = "mqdedup.rabbitmq"


@pytest.fixture
def database(pg_url: str) -> Iterator[Callable[[], TestDatabase]]:
    """Fresh framework and orders tables per call, in the shared PostgreSQL; dropped after."""
    with contextlib.ExitStack() as stack:

        def make() -> TestDatabase:
            prefix = table_prefix()
            metadata = orders_table(prefix).metadata
            return stack.enter_context(
                prefixed_database(pg_url, "PostgreSQL", metadata, prefix=prefix)
            )

        yield make


async def run_with_outage(
    consumer: Any,
    db: TestDatabase,
    metrics: Metrics,
    *,
    started_at: int,
    total: int,
    during: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Run ``consumer`` on this loop through a proxy to the database; once it processed
    ``started_at`` messages, cut the proxy for :data:`OUTAGE` seconds, note ``during()``
    and the cut's time, open it again and wait until ``total`` messages are processed."""
    target = make_url(db.url)
    stop = StopToken()
    proxy = CuttableProxy(target.host or "127.0.0.1", target.port or 5432)
    await proxy.open()
    engine = create_async_engine(target.set(host="127.0.0.1", port=proxy.listen_port))
    task = asyncio.create_task(consumer.run_async(engine, stop=stop, metrics=metrics))
    seen: dict[str, Any] = {}
    try:
        await wait_for_on_loop(
            lambda: metrics.processed >= started_at, 60, "the worker to get going"
        )
        await proxy.cut()
        seen["cut_at"] = time.time()
        await asyncio.sleep(OUTAGE)  # the outage itself: nothing to wait for
        assert not task.done(), "the worker gave up during the outage"
        seen["outage"] = metrics.outage
        seen.update(during())
        await proxy.open()  # the database is back
        await wait_for_on_loop(lambda: metrics.processed >= total, 120, "every message")
        seen["done_at"] = time.time()  # before the stop (leaving the group revokes)
    finally:
        stop.request()
        await asyncio.wait_for(task, 60)
        await engine.dispose()
        await proxy.cut()
    return seen


def logged_during(
    caplog: pytest.LogCaptureFixture,
    logger: str,
    seen: dict[str, Any],
    text: str = "",
    level: int = logging.INFO,
) -> list[logging.LogRecord]:
    """Records of ``logger`` (and its children) at ``level`` or above containing ``text``,
    logged from the cut until every message was processed (not the stop after it)."""
    return [
        r
        for r in caplog.records
        if (r.name == logger or r.name.startswith(f"{logger}."))
        and seen["cut_at"] <= r.created <= seen["done_at"]
        and r.levelno >= level
        and text in r.getMessage()
    ]


def test_async_consumers_database_stopped_20s_wait_keep_member_and_connection_lose_nothing(
    kafka_helper: KafkaHelper,
    rabbit: RabbitAdmin,
    rabbitmq_url: str,
    database: Callable[[], TestDatabase],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Kafka: 400 messages on two partitions, 6 s poll deadline (three within the outage).
    kafka_db = database()
    topic = kafka_helper.create_topic(partitions=2)
    kafka_ids = [f"o-{n:03d}" for n in range(400)]
    kafka_helper.produce(topic, [Outgoing(i, b"{}") for i in kafka_ids])
    group = unique_name("group")
    kafka_consumer = type(
        "AsyncKafkaOutage",
        (AsyncKafkaOrders,),
        {
            "topics": (topic,),
            "group_id": group,
            "bootstrap_servers": kafka_helper.bootstrap,
            "table_prefix": kafka_db.prefix,
            "batch_size": 20,
            "poll_timeout": 0.2,
            "kafka_config": {**FAST_GROUP, "max_poll_interval_ms": 6000},
            "retry_policy": RETRY,
        },
    )()
    kafka_metrics = Metrics()

    # RabbitMQ: 300 messages, a 2 s heartbeat (ten intervals within the outage).
    rabbit_db = database()
    queue = unique_name("rabbitmq")  # declared below with the consumer's topology
    rabbit.created += [queue, f"{queue}.dlq"]
    heartbeat = 2
    separator = "&" if "?" in rabbitmq_url else "?"
    rabbit_ids = [f"o-{n:03d}" for n in range(300)]
    rabbit_consumer = type(
        "AsyncRabbitOutage",
        (AsyncRabbitOrders,),
        {
            "queue": queue,
            "url": f"{rabbitmq_url}{separator}heartbeat={heartbeat}",
            "table_prefix": rabbit_db.prefix,
            "poll_timeout": 0.2,
            "retry_policy": RETRY,
        },
    )()
    rabbit.declare(rabbit_consumer)
    rabbit.publish(queue, rabbit_ids)
    rabbit_metrics = Metrics()

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        return await asyncio.gather(
            run_with_outage(
                kafka_consumer,
                kafka_db,
                kafka_metrics,
                started_at=60,
                total=len(kafka_ids),
                during=dict,
            ),
            run_with_outage(
                rabbit_consumer,
                rabbit_db,
                rabbit_metrics,
                started_at=40,
                total=len(rabbit_ids),
                during=lambda: {"consumers": consumers(rabbit, queue)},
            ),
        )

    with (
        caplog.at_level(logging.INFO, logger=KAFKA_LOGGER),
        caplog.at_level(logging.INFO, logger=RABBIT_LOGGER),
    ):
        kafka_seen, rabbit_seen = asyncio.run(both())

    # Kafka: waited, kept the member, lost and doubled nothing.
    assert str(kafka_seen["outage"]).startswith("database unavailable"), kafka_seen
    revoked = logged_during(caplog, KAFKA_LOGGER, kafka_seen, "partitions revoked")
    assert revoked == [], "the group dropped the member during the outage"
    assert kafka_metrics.dead_lettered == 0
    assert row_counts(kafka_db.engine, kafka_db.prefix) == dict.fromkeys(kafka_ids, 1)
    assert kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic)

    # RabbitMQ: waited, kept its connection and consumer, lost and doubled nothing.
    assert str(rabbit_seen["outage"]).startswith("database unavailable"), rabbit_seen
    assert rabbit_seen["consumers"] == 1, "the worker's consumer left the queue in the outage"
    lost = logged_during(caplog, RABBIT_LOGGER, rabbit_seen, level=logging.WARNING)
    assert lost == [], f"the connection was lost during the outage: {lost}"
    assert rabbit_metrics.duplicates == 0, "the unacked batch was redelivered: connection broke"
    assert rabbit_metrics.dead_lettered == 0
    assert row_counts(rabbit_db.engine, rabbit_db.prefix) == dict.fromkeys(rabbit_ids, 1)
    wait_for(lambda: rabbit.depth(queue) == 0, 30, "the queue drained")
    assert rabbit.depth(f"{queue}.dlq") == 0
