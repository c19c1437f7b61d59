"""RabbitMQ: duplicates (same message_id) are skipped; every message is acked after commit."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mqdedup import Message
from mqdedup.errors import SimulatedCrash
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import (
    ThreadedWorker,
    claims,
    make_consumer,
    order_counts,
    with_duplicates,
)
from tests.services import RabbitAdmin, wait_for

pytestmark = pytest.mark.integration


def test_6k_messages_with_30pct_duplicates_write_each_order_once(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    ids = with_duplicates(6_000, 0.3)
    unique = set(ids)
    assert (len(ids), len(unique)) == (6_000, 4_200)
    consumer = make_consumer(queue, db.prefix, rabbitmq_url, batch_size=500)()
    broker.declare(consumer)
    broker.publish(queue, ids)

    with ThreadedWorker(consumer, db.engine) as worker:
        wait_for(
            lambda: worker.metrics.processed + worker.metrics.duplicates >= 6_000,
            180,
            "6,000 deliveries to be processed or skipped",
        )
        metrics = worker.finish()

    counts = order_counts(db.engine, db.orders)
    assert len(counts) == 4_200 and set(counts.values()) == {1}, "one business row per id"
    assert set(counts) == unique
    assert claims(db.engine, db.prefix, queue) == unique  # consumer name = queue name
    assert (metrics.processed, metrics.duplicates, metrics.dead_lettered) == (4_200, 1_800, 0)
    # After the connection closed, nothing came back: every delivery was acked.
    assert broker.depth(queue) == 0
    assert broker.depth(f"{queue}.dlq") == 0
    assert worker.transport.reconnects == 0


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_batch_committed_but_not_acked_is_redelivered_and_skipped(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, queue_type: str
) -> None:
    """The worker dies after the commit, before the ack: the next one skips the batch."""
    ids = [f"r{number:04d}" for number in range(300)]
    consumer_class = make_consumer(
        queue, db.prefix, rabbitmq_url, batch_size=50, queue_type=queue_type
    )

    class CrashesAfterCommit(consumer_class):  # type: ignore[misc,valid-type]
        def after_commit(self, messages: Sequence[Message]) -> None:
            if any(message.id == "r0120" for message in messages):
                self.crashed_batch = [str(message.id) for message in messages]
                raise SimulatedCrash("after commit, before ack")

    first = CrashesAfterCommit()
    broker.declare(first)
    broker.publish(queue, ids)
    worker = ThreadedWorker(first, db.engine)
    worker.thread.start()
    worker.thread.join(60)
    assert isinstance(worker.error, SimulatedCrash)
    crashed = set(first.crashed_batch)
    assert "r0120" in crashed
    committed = order_counts(db.engine, db.orders)
    assert crashed <= set(committed)  # the crashed batch had committed

    second = consumer_class()
    with ThreadedWorker(second, db.engine) as worker:
        wait_for(
            lambda: len(order_counts(db.engine, db.orders)) == 300 and broker.depth(queue) == 0,
            60,
            "every order written and the queue drained",
        )
        metrics = worker.finish()

    counts = order_counts(db.engine, db.orders)
    assert set(counts) == set(ids) and set(counts.values()) == {1}, "no order written twice"
    assert set(second.duplicate_ids) == crashed, "exactly the unacked batch came back"
    assert metrics.duplicates == len(crashed)
    assert all(message.redelivered for message in second.duplicate_messages)
    if queue_type == "quorum":  # quorum queues count deliveries in x-delivery-count
        assert all(message.attempt >= 2 for message in second.duplicate_messages)
    assert broker.depth(queue) == 0
