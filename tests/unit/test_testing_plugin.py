"""The user-facing test kit, used the way a user would use it on their own consumer."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from mqdedup import RetryPolicy
from mqdedup.testing import ConsumerHarness, EffectivelyOnceError, assert_effectively_once
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
