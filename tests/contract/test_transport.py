"""The Transport contract (``mqdedup/consumers/transport.py``), run against every transport.

Each test gets a fresh source from its kit (``conftest.py``): the in-memory broker, a
Kafka topic with two partitions, a RabbitMQ queue. The tests assert what a user relies
on: what is on the broker, what is committed, what the dead-letter destination holds.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict

from sqlalchemy import func, select

from mqdedup import RetryPolicy
from mqdedup.consumers.transport import DeadLetter
from mqdedup.consumers.worker import Worker
from mqdedup.stopping import StopToken
from tests.contract.conftest import (
    OrdersDatabase,
    TransportKit,
    fetch,
    ids_of,
    raws,
)
from tests.services import wait_for

REASON = DeadLetter(
    reason="handler failed after 3 attempts",
    consumer="contract",
    attempts=3,
    error_class="ValueError",
    error_message="boom",
)


def test_fetch_hands_out_what_was_published(transport_kit: TransportKit) -> None:
    published = raws(6)
    transport_kit.publish(published)
    consumer = transport_kit.consumer_class()()
    transport = transport_kit.transport(consumer)

    deliveries = fetch(transport, len(published))

    by_id = {raw.id: raw for raw in published}
    assert sorted(ids_of(consumer, deliveries)) == sorted(by_id)
    for delivery in deliveries:
        raw = by_id[consumer.message_id(delivery.message)]
        assert delivery.message.body == raw.body
        assert delivery.message.header("x-test") == raw.headers["x-test"]
        assert not delivery.message.redelivered
        if transport_kit.features.keeps_key:
            assert delivery.message.key == raw.key
    transport.close()


def test_nothing_is_settled_before_settle(transport_kit: TransportKit) -> None:
    """Closed without settling: every message comes again (a crash loses nothing)."""
    published = raws(5)
    transport_kit.publish(published)
    consumer = transport_kit.consumer_class()()
    first = transport_kit.transport(consumer)
    fetch(first, len(published))
    first.close()

    assert transport_kit.remaining() == len(published)
    again = fetch(transport_kit.transport(consumer), len(published))
    assert sorted(ids_of(consumer, again)) == [raw.id for raw in published]
    if transport_kit.features.flags_redelivery:
        assert all(delivery.message.redelivered for delivery in again)


def test_settled_deliveries_are_gone_for_good_and_the_rest_come_again(
    transport_kit: TransportKit,
) -> None:
    published = raws(8)
    transport_kit.publish(published)
    consumer = transport_kit.consumer_class()()
    transport = transport_kit.transport(consumer)
    deliveries = fetch(transport, len(published))
    settled, unsettled = deliveries[:5], deliveries[5:]
    transport.settle(settled)
    transport.close()

    assert transport_kit.remaining() == len(unsettled)
    again = fetch(transport_kit.transport(consumer), len(unsettled))
    assert sorted(ids_of(consumer, again)) == sorted(ids_of(consumer, unsettled))


def test_dead_letter_keeps_the_original_and_the_reason_before_it_returns(
    transport_kit: TransportKit,
) -> None:
    published = raws(4)
    transport_kit.publish(published)
    consumer = transport_kit.consumer_class()()
    transport = transport_kit.transport(consumer)
    deliveries = fetch(transport, len(published))
    poison = next(d for d in deliveries if consumer.message_id(d.message) == "m002")

    transport.dead_letter(poison, REASON)
    [stored] = transport_kit.dead_letters(expected=1)  # stored before settle
    transport.settle(deliveries)
    transport.close()

    original = published[2]
    assert stored.body == original.body
    assert stored.message_id == original.id
    assert stored.headers["x-test"] == original.headers["x-test"]
    assert stored.headers["x-mqdedup-reason"] == REASON.reason
    assert stored.headers["x-mqdedup-consumer"] == "contract"
    assert stored.headers["x-mqdedup-attempts"] == "3"
    assert stored.headers["x-mqdedup-error-class"] == "ValueError"
    assert stored.headers["x-mqdedup-error-message"] == "boom"
    if transport_kit.features.keeps_key:
        assert stored.key == original.key
    assert transport_kit.remaining() == 0


def test_given_back_deliveries_are_fetched_again(transport_kit: TransportKit) -> None:
    published = raws(8)
    transport_kit.publish(published)
    consumer = transport_kit.consumer_class()()
    transport = transport_kit.transport(consumer)
    deliveries = fetch(transport, len(published))
    kept, returned = deliveries[:4], deliveries[4:]
    transport.settle(kept)

    transport.give_back(returned)
    again = fetch(transport, len(returned))
    assert sorted(ids_of(consumer, again)) == sorted(ids_of(consumer, returned))
    transport.settle(again)
    transport.close()
    assert transport_kit.remaining() == 0


def test_order_is_kept_within_a_partition_or_queue(transport_kit: TransportKit) -> None:
    published = raws(30, keys=3)
    transport_kit.publish(published)
    transport = transport_kit.transport()
    deliveries = fetch(transport, len(published))
    transport.close()

    sequence = [json.loads(d.message.body) for d in deliveries]
    if transport_kit.features.ordering == "queue":
        assert [item["n"] for item in sequence] == list(range(30))
    else:
        per_key: dict[str, list[int]] = defaultdict(list)
        for item in sequence:
            per_key[item["key"]].append(item["n"])
        for key, numbers in per_key.items():
            assert numbers == sorted(numbers), f"{key} out of order: {numbers}"


def test_keepalive_keeps_a_batch_held_past_the_brokers_poll_deadline(
    transport_kit: TransportKit,
) -> None:
    """A long batch (slow handler, database outage) must not cost the deliveries."""
    published = raws(6)
    transport_kit.publish(published)
    transport = transport_kit.transport()
    deliveries = fetch(transport, len(published))

    deadline = transport_kit.features.poll_deadline
    held_until = time.monotonic() + (deadline * 2 if deadline else 0.2)
    while time.monotonic() < held_until:
        transport.keepalive()
        time.sleep(0.2)  # the handler "works"; keepalive is what the processor calls
    transport.settle(deliveries)
    transport.close()

    assert transport_kit.remaining() == 0, "the settle after the long batch was lost"


def test_a_batch_through_worker_and_processor_settles_exactly_what_committed(
    transport_kit: TransportKit, orders_db: OrdersDatabase
) -> None:
    published = raws(40)
    transport_kit.publish(published + published[:10])  # 10 duplicates
    consumer = transport_kit.consumer_class(
        orders=orders_db.orders,
        table_prefix=orders_db.db.prefix,
        fail_ids=frozenset({"m020"}),
        retry_policy=RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02),
    )()
    stop = StopToken()
    worker = Worker(consumer, transport_kit.transport(consumer), orders_db.db.engine, stop=stop)
    runner = threading.Thread(target=worker.run, name="contract-worker", daemon=True)
    runner.start()
    try:
        wait_for(
            lambda: worker.metrics.dead_lettered == 1 and _rows(orders_db) == 39,
            60,
            "39 rows and one dead letter",
        )
    finally:
        stop.request()
        runner.join(60)
    assert not runner.is_alive(), "the worker did not stop"

    with orders_db.db.engine.connect() as connection:
        counts: Counter[str] = Counter(
            dict(
                connection.execute(
                    select(orders_db.orders.c.message_id, func.count()).group_by(
                        orders_db.orders.c.message_id
                    )
                ).all()
            )
        )
    assert set(counts) == {raw.id for raw in published} - {"m020"}
    assert set(counts.values()) == {1}, "a message's effects committed twice"
    [dead] = transport_kit.dead_letters(expected=1)
    assert dead.message_id == "m020"
    assert "ValueError" in dead.headers["x-mqdedup-error-class"]
    assert transport_kit.remaining() == 0, "something committed was left unsettled"


def _rows(orders_db: OrdersDatabase) -> int:
    with orders_db.db.engine.connect() as connection:
        return int(
            connection.execute(select(func.count()).select_from(orders_db.orders)).scalar_one()
        )
