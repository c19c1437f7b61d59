"""The user-facing test kit on real brokers: it passes the outbox notifier and catches
the notifier that publishes directly (issue #8).

Real Kafka / RabbitMQ, the shared PostgreSQL, real worker processes killed with
``kill -9`` (``mqdedup.testing.brokers``), the real relay. Each harness has its own
topic / queue, group and table prefix; the four runs go side by side in one test.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from examples.testing_sample.notify import (
    DirectOrderNotifier,
    DirectRabbitOrderNotifier,
    OrderNotifier,
    RabbitOrderNotifier,
    orders_table,
)
from mqdedup.testing import EffectivelyOnceError, assert_effectively_once, downstream_effects
from mqdedup.testing.brokers import BrokerHarness, KafkaHarness, RabbitMQHarness

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ORDERS = 40


def order_counts(harness: BrokerHarness) -> dict[str, int]:
    """Order rows per incoming message id (the business effect in the database)."""
    table = orders_table(harness.prefix)
    with harness.engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


@pytest.fixture
def tables() -> Iterator[Callable[[BrokerHarness], None]]:
    """Create the sample's orders table under a harness's prefix; dropped at the end."""
    created: list[tuple[Engine, str]] = []

    def create(harness: BrokerHarness) -> None:
        orders_table(harness.prefix).create(harness.engine)
        created.append((harness.engine, harness.prefix))

    yield create
    for engine, prefix in created:
        orders_table(prefix).drop(engine, checkfirst=True)


@pytest.fixture
def kafka_kit(
    mqdedup_kafka_harness: Callable[..., KafkaHarness],
    pg_url: str,
    kafka_bootstrap: str,
    tables: Callable[[BrokerHarness], None],
) -> Callable[[type[OrderNotifier]], tuple[KafkaHarness, str]]:

    def make(consumer: type[OrderNotifier]) -> tuple[KafkaHarness, str]:
        harness = mqdedup_kafka_harness(consumer, database_url=pg_url)
        notifications = harness.create_topic("notifications")
        harness.user_attributes.update(notifications_topic=notifications, batch_size=5)
        tables(harness)
        for number in range(ORDERS):
            harness.publish({"order": number}, message_id=f"order-{number}")
        harness.deliver_each_twice()
        return harness, notifications

    return make


@pytest.fixture
def rabbitmq_kit(
    mqdedup_rabbitmq_harness: Callable[..., RabbitMQHarness],
    pg_url: str,
    rabbitmq_url: str,
    tables: Callable[[BrokerHarness], None],
) -> Callable[[type[RabbitOrderNotifier]], tuple[RabbitMQHarness, str]]:

    def make(consumer: type[RabbitOrderNotifier]) -> tuple[RabbitMQHarness, str]:
        harness = mqdedup_rabbitmq_harness(consumer, database_url=pg_url)
        notifications = harness.declare_queue("notifications")
        harness.user_attributes.update(notifications_queue=notifications, batch_size=5)
        tables(harness)
        for number in range(ORDERS):
            harness.publish({"order": number}, message_id=f"order-{number}")
        harness.deliver_each_twice()
        return harness, notifications

    return make


def kafka_outbox_notifier_is_effectively_once_under_kills_and_a_rebalance(
    harness: KafkaHarness, notifications: str
) -> None:
    assert harness.run_killing_after_commit(times=2) == 2
    assert harness.run_killing_mid_batch(after_messages=3)
    shares = harness.run_with_rebalance()
    # The first worker committed a batch and was held; the second joined, was assigned
    # partitions and committed new messages from them; both left with exit code 0.
    assert shares["first"] > 0 and shares["second"] > 0, shares
    harness.run_until_drained()
    assert harness.run_relay() >= ORDERS

    assert harness.kills == 3
    assert_effectively_once(order_counts(harness), harness.ids)
    sent = harness.read_topic(notifications, at_least=ORDERS)
    assert_effectively_once(downstream_effects(sent), harness.ids)


def kafka_kit_catches_the_handler_that_publishes_directly(
    harness: KafkaHarness, notifications: str
) -> None:
    assert harness.run_killing_mid_batch(after_messages=3)
    harness.run_until_drained()

    assert_effectively_once(order_counts(harness), harness.ids)  # the rows are deduplicated
    sent = harness.read_topic(notifications, at_least=ORDERS + 3)
    with pytest.raises(EffectivelyOnceError, match=r"3 message id\(s\) applied more than once"):
        assert_effectively_once(downstream_effects(sent), harness.ids)


def rabbitmq_outbox_notifier_is_effectively_once_under_kills(
    harness: RabbitMQHarness, notifications: str
) -> None:
    assert harness.run_killing_after_commit(times=2) == 2
    assert harness.run_killing_mid_batch(after_messages=3)
    harness.run_until_drained()
    assert harness.run_relay() >= ORDERS

    assert_effectively_once(order_counts(harness), harness.ids)
    sent = harness.read_queue(notifications, at_least=ORDERS)
    assert_effectively_once(downstream_effects(sent), harness.ids)


def rabbitmq_kit_catches_the_handler_that_publishes_directly(
    harness: RabbitMQHarness, notifications: str
) -> None:
    assert harness.run_killing_mid_batch(after_messages=3)
    harness.run_until_drained()

    assert_effectively_once(order_counts(harness), harness.ids)
    sent: list[Any] = harness.read_queue(notifications, at_least=ORDERS + 3)
    with pytest.raises(EffectivelyOnceError, match=r"3 message id\(s\) applied more than once"):
        assert_effectively_once(downstream_effects(sent), harness.ids)


def test_the_kit_passes_the_outbox_notifiers_and_catches_the_direct_ones_on_both_brokers(
    kafka_kit: Callable[[type[OrderNotifier]], tuple[KafkaHarness, str]],
    rabbitmq_kit: Callable[[type[RabbitOrderNotifier]], tuple[RabbitMQHarness, str]],
) -> None:
    """The four harness runs above side by side, each in a thread of its own with its own
    topic / queue, group, tables and worker processes: their worker starts and Kafka's
    session timeouts after each kill overlap instead of adding up. Each run asserts its
    own outcome; the first failure is raised with its traceback."""
    runs: dict[str, Callable[[], None]] = {
        "kafka outbox notifier": functools.partial(
            kafka_outbox_notifier_is_effectively_once_under_kills_and_a_rebalance,
            *kafka_kit(OrderNotifier),
        ),
        "kafka direct notifier": functools.partial(
            kafka_kit_catches_the_handler_that_publishes_directly,
            *kafka_kit(DirectOrderNotifier),
        ),
        "rabbitmq outbox notifier": functools.partial(
            rabbitmq_outbox_notifier_is_effectively_once_under_kills,
            *rabbitmq_kit(RabbitOrderNotifier),
        ),
        "rabbitmq direct notifier": functools.partial(
            rabbitmq_kit_catches_the_handler_that_publishes_directly,
            *rabbitmq_kit(DirectRabbitOrderNotifier),
        ),
    }
    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="kit") as pool:
        futures = {name: pool.submit(run) for name, run in runs.items()}
        wait(futures.values())
    for future in futures.values():
        future.result()
