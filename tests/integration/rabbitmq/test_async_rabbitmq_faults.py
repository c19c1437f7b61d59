"""AsyncRabbitMQConsumer (the pika transport, driven from an event loop) under faults,
against the real RabbitMQ and PostgreSQL.

``AsyncRabbitMQConsumer`` (``async def handle`` writing through the ``AsyncSession``):

* worker processes of the test kit (the same ``consumer.run(engine)`` as ``mqdedup
  worker``), 30% duplicates, three killed with ``kill -9`` after their commit and before
  the ack, a poison message: a rerun drains the queue, each effect once, the poison
  message in the dead-letter queue with its reason;
* the broker closes the worker's connection while a batch is in flight, three times:
  the robust connection comes back, the batch commits, its acks are not sent on the new
  channel, the broker redelivers it and the dedup skips it: each effect once;
* a dead letter the broker refuses (publisher nack) is kept in the database with the
  reason, and its batch-mates go on;
* the database stopped for 20 s: ``tests/integration/asyncio/test_async_database_outage.py``
  (side by side with the async Kafka worker's outage).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from sqlalchemy import insert

from mqdedup import AsyncContext, Message, RetryPolicy
from mqdedup.rabbitmq import AsyncRabbitMQConsumer
from mqdedup.stopping import StopToken
from mqdedup.testing.brokers import RabbitMQHarness
from tests.integration.kafka.helpers import row_counts, run_until_parked
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import close_connections
from tests.services import RabbitAdmin, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration]

POISON = "poison-1"


class AsyncRabbitOrders(AsyncRabbitMQConsumer):
    """One order row per message through the AsyncSession; ``poison`` bodies fail."""

    __test__ = False
    queue = "set-by-the-harness"
    batch_size = 20
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02)
    #: Message ids whose first handling waits (on the loop) until the test releases them.
    hold: ClassVar[dict[str, tuple[threading.Event, threading.Event]]] = {}
    #: Message ids found to be duplicates (``on_duplicate``), in order.
    duplicate_ids: ClassVar[list[str]] = []

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        if message.json().get("poison"):
            raise ValueError(f"cannot handle {message.id}")
        gates = type(self).hold.pop(message.id or "", None)
        if gates is not None:
            reached, release = gates
            reached.set()
            while not release.is_set():  # the loop (and the reconnect) goes on meanwhile
                await asyncio.sleep(0.02)
        await ctx.session.execute(
            insert(orders_table(self.table_prefix)).values(
                message_id=message.id, body=message.text()[:255]
            )
        )
        return None

    async def on_duplicate(self, message: Message, stored_result: Any) -> None:
        type(self).duplicate_ids.append(str(message.id))


def consumers(broker: RabbitAdmin, queue: str) -> int:
    """Consumers attached to ``queue`` (a passive declare: no rabbitmqctl round trip)."""
    return int(broker.channel().queue_declare(queue, passive=True).method.consumer_count)


def with_duplicates(count: int) -> tuple[list[str], list[str]]:
    """``count`` ids, and the publishing order with 30% of them sent again later."""
    ids = [f"order-{n:04d}" for n in range(count)]
    return ids, ids + random.Random(7).sample(ids, count * 3 // 10)


@pytest.mark.slow
def test_async_rabbitmq_workers_killed_after_commit_with_duplicates_and_a_poison_message(
    mqdedup_rabbitmq_harness: Callable[..., RabbitMQHarness], pg_url: str, rabbitmq_url: str
) -> None:
    harness = mqdedup_rabbitmq_harness(AsyncRabbitOrders, database_url=pg_url)
    orders = orders_table(harness.prefix)
    orders.create(harness.engine)
    admin = RabbitAdmin(rabbitmq_url)
    try:
        ids, sent = with_duplicates(200)
        for message_id in sent:
            harness.publish({"id": message_id}, message_id=message_id)
        harness.publish({"poison": True}, message_id=POISON)

        assert harness.run_killing_after_commit(times=3) == 3
        harness.run_until_drained()

        assert row_counts(harness.engine, harness.prefix) == dict.fromkeys(ids, 1)
        [(properties, body)] = admin.peek_all(f"{harness.queue}.dlq")
        headers = {
            k: v.decode() if isinstance(v, bytes) else v for k, v in properties.headers.items()
        }
        assert properties.message_id == POISON
        assert body == b'{"poison": true}'
        assert headers["x-mqdedup-error-class"].endswith("ValueError")
        assert headers["x-mqdedup-attempts"] == "2"
        assert "cannot handle poison-1" in headers["x-mqdedup-error-message"]
        assert headers["x-mqdedup-source-queue"] == harness.queue
    finally:
        admin.close()
        orders.drop(harness.engine, checkfirst=True)


@pytest.mark.slow
def test_async_rabbitmq_broker_closing_the_connection_mid_batch_loses_and_doubles_nothing(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, rabbitmqctl: list[str]
) -> None:
    ids, sent = with_duplicates(300)
    copied = set(sent[len(ids) :])
    # Held messages that are sent once: a duplicate of one is its batch coming back.
    triggers = [next(i for i in ids[start:] if i not in copied) for start in (40, 140, 240)]
    gates = {trigger: (threading.Event(), threading.Event()) for trigger in triggers}
    name = f"mqdedup-test-async:{queue}"
    consumer_class = type(
        "AsyncRabbitOrdersClosed",
        (AsyncRabbitOrders,),
        {
            "queue": queue,
            "url": rabbitmq_url,
            "table_prefix": db.prefix,
            "connection_name": name,
            "reconnect_interval": 0.2,
            "poll_timeout": 0.2,
            "hold": dict(gates),
            "duplicate_ids": [],
        },
    )
    consumer = consumer_class()
    broker.declare(consumer)
    broker.publish(queue, sent)  # JSON bodies {"id": ...}
    stop = StopToken()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["metrics"] = consumer.run(db.engine, stop=stop)
        except BaseException as error:
            outcome["error"] = error

    runner = threading.Thread(target=run, name="async-rabbit-worker", daemon=True)
    runner.start()
    try:
        for number, trigger in enumerate(triggers, start=1):
            reached, release = gates[trigger]
            assert reached.wait(60), f"the batch with {trigger} never started: {outcome}"
            assert close_connections(rabbitmqctl, name, f"mqdedup async test close {number}") == 1
            # The robust connection comes back while the handler holds the batch whose
            # deliveries died with the old channel.
            wait_for(lambda: consumers(broker, queue) == 1, 60, f"reconnect {number}")
            release.set()  # the batch commits; its acks are dropped, not sent
        wait_for(
            lambda: len(row_counts(db.engine, db.prefix)) == len(ids) and broker.depth(queue) == 0,
            120,
            "every order written and the queue drained",
        )
    finally:
        for _, release in gates.values():
            release.set()
        stop.request()
        runner.join(60)
    assert not runner.is_alive(), "the worker did not stop"
    assert "error" not in outcome, outcome
    metrics = outcome["metrics"]
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(ids, 1), "lost or doubled"
    assert metrics.processed == len(ids)
    assert set(triggers) <= set(consumer_class.duplicate_ids), "held batches not redelivered"
    assert metrics.dead_lettered == 0
    assert broker.depth(f"{queue}.dlq") == 0
    # Copies still unhandled at the stop went back to the queue; they are duplicates only.
    left = {properties.message_id for properties, _ in broker.peek_all(queue)}
    assert left <= set(ids)


def test_async_rabbitmq_dead_letter_refused_by_the_broker_is_kept_in_the_database(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    """A dead-letter queue that refuses publishes (``x-max-length`` 0, ``reject-publish``)
    nacks the copy: it is parked in the database with the reason; the rest goes on."""
    good = [f"a-{n}" for n in range(30)]
    consumer = type(
        "AsyncRabbitRefused",
        (AsyncRabbitOrders,),
        {
            "queue": queue,
            "url": rabbitmq_url,
            "table_prefix": db.prefix,
            "poll_timeout": 0.2,
            "dead_letter_queue_arguments": {"x-max-length": 0, "x-overflow": "reject-publish"},
        },
    )()
    broker.declare(consumer)
    broker.publish(queue, good[:15])
    broker.publish(queue, [POISON], body=lambda _id: b'{"poison": true}')
    broker.publish(queue, good[15:])
    kept, outcome = run_until_parked(consumer, db, good)
    assert kept.message.id == POISON and kept.message.body == b'{"poison": true}'
    assert "refused" in kept.refusal and f"{queue}.dlq" in kept.refusal
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(good, 1)
    assert outcome.dead_letters_parked == 1
    assert broker.depth(queue) == 0 and broker.depth(f"{queue}.dlq") == 0
