"""The user-facing test kit, used the way a user would use it on their own consumer."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select

from examples.testing_sample.notify import DirectOrderNotifier, OrderNotifier, orders_table
from mqdedup import RetryPolicy
from mqdedup.consumers.memory import InMemoryBroker
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.testing import (
    ConsumerHarness,
    DownstreamMessage,
    EffectivelyOnceError,
    assert_effectively_once,
    downstream_effects,
)
from tests.support import BulkOrderConsumer, OrderConsumer, business, order_counts


class SampleConsumer(OrderConsumer):
    retry_policy = RetryPolicy(initial_backoff=0.001)
    batch_size = 20


@pytest.fixture
def engine(mqdedup_engine: Engine) -> Engine:
    business.create_all(mqdedup_engine)
    return mqdedup_engine


@pytest.mark.parametrize("consumer_class", [SampleConsumer, BulkOrderConsumer])
def test_sample_consumer_is_effectively_once_under_every_fault(
    mqdedup_harness, engine: Engine, consumer_class: type[OrderConsumer]
) -> None:
    harness: ConsumerHarness = mqdedup_harness(consumer_class)
    for number in range(200):
        harness.publish({"order": number, "amount": 1}, message_id=f"order-{number}")
    assert harness.deliver_each_twice() == 200
    harness.run_crashing_after_commit(times=3)
    harness.run_crashing_mid_batch(after_messages=7)
    harness.run()

    assert harness.crashes == 4
    assert_effectively_once(order_counts(engine), harness.ids)
    assert not harness.dead_letters


def test_the_kit_catches_a_consumer_that_is_not_idempotent(mqdedup_harness, engine: Engine) -> None:
    class NoDedup(SampleConsumer):
        deduplicate = False

    harness: ConsumerHarness = mqdedup_harness(NoDedup)
    for number in range(50):
        harness.publish({"order": number}, message_id=f"order-{number}")
    harness.run_crashing_after_commit(times=1)
    harness.run()
    with pytest.raises(EffectivelyOnceError, match="applied more than once"):
        assert_effectively_once(order_counts(engine), harness.ids)


def test_assert_effectively_once_reports_missing_and_unexpected_ids() -> None:
    with pytest.raises(EffectivelyOnceError, match="never applied"):
        assert_effectively_once({"a": 1}, ["a", "b"])
    with pytest.raises(EffectivelyOnceError, match="unexpected"):
        assert_effectively_once({"a": 1, "z": 1}, ["a"])
    assert_effectively_once({"a": 1}, ["a", "b"], allow_missing=True)


# -- the sample pair: notifications through the outbox vs published directly -------------


class MemoryDirectNotifier(DirectOrderNotifier):
    """The broken sample with its producer pointed at the in-memory broker."""

    retry_policy = RetryPolicy(initial_backoff=0.001)

    def __init__(self, broker: InMemoryBroker) -> None:
        self.broker = broker

    def send(self, topic: str, body: bytes, headers: dict[str, str]) -> None:
        self.broker.publish(topic, body, headers=headers)


class MemoryOrderNotifier(OrderNotifier):
    retry_policy = RetryPolicy(initial_backoff=0.001)


def sample_order_counts(engine: Engine) -> dict[str, int]:
    table = orders_table(DEFAULT_PREFIX)
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


def run_every_fault(harness: ConsumerHarness, orders: int = 60) -> None:
    for number in range(orders):
        harness.publish({"order": number}, message_id=f"order-{number}")
    harness.deliver_each_twice()
    harness.run_crashing_after_commit(times=2)
    harness.run_crashing_mid_batch(after_messages=5)
    harness.run()


def test_outbox_notifier_sends_each_notification_effectively_once(
    mqdedup_harness, mqdedup_engine: Engine
) -> None:
    orders_table(DEFAULT_PREFIX).create(mqdedup_engine)
    harness: ConsumerHarness = mqdedup_harness(MemoryOrderNotifier)
    run_every_fault(harness)
    assert harness.run_relay() >= 60

    assert harness.crashes == 3
    assert_effectively_once(sample_order_counts(mqdedup_engine), harness.ids)
    notifications = harness.downstream(OrderNotifier.notifications_topic)
    assert_effectively_once(downstream_effects(notifications), harness.ids)
    assert len({n.message_id for n in notifications}) == 60


def test_the_kit_catches_a_handler_that_publishes_directly(
    mqdedup_harness, mqdedup_engine: Engine
) -> None:
    orders_table(DEFAULT_PREFIX).create(mqdedup_engine)
    broker = InMemoryBroker(seed=0)  # the crash points depend on the order
    harness: ConsumerHarness = mqdedup_harness(lambda: MemoryDirectNotifier(broker), broker=broker)
    run_every_fault(harness)

    # The database effects are deduplicated either way ...
    assert_effectively_once(sample_order_counts(mqdedup_engine), harness.ids)
    # ... but the handler run that the mid-batch crash rolled back had already sent
    # its notifications, with ids the next consumer cannot recognise as repeats.
    effects = downstream_effects(harness.downstream(OrderNotifier.notifications_topic))
    with pytest.raises(EffectivelyOnceError, match=r"5 message id\(s\) applied more than once"):
        assert_effectively_once(effects, harness.ids)


def test_downstream_effects_count_distinct_ids_per_cause() -> None:
    def sent(message_id: str | None, cause: str) -> DownstreamMessage:
        return DownstreamMessage(message_id=message_id, cause=cause, body=b"")

    effects = downstream_effects(
        [sent("x", "a"), sent("x", "a"), sent("y", "b"), sent("z", "b"), sent(None, "c")]
    )
    assert effects == {"a": 1, "b": 2, "c": 1}
