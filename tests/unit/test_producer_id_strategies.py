"""Id strategies for producers that send no message id: what each one makes one message.

Each strategy is run through a consumer on the in-memory broker, so the test counts
effects (rows), not return values: the copies each strategy is meant to merge write one
row; the messages it must keep apart write one each.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import Engine

from mqdedup import InMemoryBroker, Message, ids, run_until_idle
from mqdedup.errors import MissingMessageIdError
from tests.support import OrderConsumer, order_counts


def consume(engine: Engine, strategy: ids.MessageIdStrategy, publish: Any) -> InMemoryBroker:
    class Orders(OrderConsumer):
        message_id_strategy = strategy

    broker = InMemoryBroker()
    publish(broker)
    run_until_idle(Orders(), broker.transport("orders"), engine)
    return broker


def body(order: int, **extra: Any) -> str:
    return json.dumps({"order": order, "amount": 1, **extra})


def test_correlation_id_from_the_amqp_property_or_the_kafka_header(sqlite_engine: Engine) -> None:
    def publish(broker: InMemoryBroker) -> None:
        # FastStream over RabbitMQ: the AMQP property; over Kafka: the header (bytes)
        broker.publish("orders", body(1), properties={"correlation_id": "c-1"})
        broker.publish("orders", body(1), properties={"correlation_id": "c-1"})  # redelivery
        broker.publish("orders", body(2), headers={"correlation_id": b"c-2"})
        broker.publish("orders", body(2), headers={"correlation_id": b"c-2"})
        broker.publish("orders", body(1), properties={"correlation_id": "c-3"})  # a 2nd publish
        broker.publish("orders", body(4))  # none: dead-lettered with the reason

    broker = consume(sqlite_engine, ids.from_correlation_id(), publish)
    assert order_counts(sqlite_engine) == {"c-1": 1, "c-2": 1, "c-3": 1}
    (letter,) = broker.dead_letters["orders"]
    assert letter.record.reason == (
        "missing message id: no AMQP correlation_id property or 'correlation_id' header"
    )


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("order", {"o-1": 1, "o-2": 1}),
        ("$.meta.ref", {"o-r1": 1, "o-r2": 1}),
        ("lines[0].sku", {"o-a": 1, "o-b": 1}),
        (lambda b: f"{b['type']}:{b['order']}", {"o-placed:1": 1, "o-placed:2": 1}),
    ],
)
def test_a_business_key_from_the_body_merges_every_copy_of_the_same_fact(
    sqlite_engine: Engine, key: Any, expected: dict[str, int]
) -> None:
    def publish(broker: InMemoryBroker) -> None:
        for copy in range(3):  # a producer retry, a second publish, a redelivery
            for order, ref, sku in ((1, "r1", "a"), (2, "r2", "b")):
                extra = {"meta": {"ref": ref}, "lines": [{"sku": sku}], "type": "placed"}
                broker.publish("orders", body(order, copy=copy, **extra))

    consume(sqlite_engine, ids.from_body_key(key, prefix="o-"), publish)
    assert order_counts(sqlite_engine) == expected


def test_a_body_without_the_key_has_no_id_and_first_of_falls_back(sqlite_engine: Engine) -> None:
    strategy = ids.from_body_key("order_id")
    for payload, reason in [
        (b"not json", "no body key 'order_id': the body is not JSON"),
        (b'{"other": 1}', "no body key 'order_id'"),
    ]:
        with pytest.raises(MissingMessageIdError, match=reason):
            strategy(Message(body=payload))
    with pytest.raises(MissingMessageIdError, match="is a float, not a string or an integer"):
        strategy(Message(body=b'{"order_id": 1.5}'))
    assert strategy(Message(body=b'{"order_id": 7}')) == "7"
    chained = ids.first_of(ids.from_body_key("order_id"), ids.from_content_hash)
    assert chained(Message(body=b"{}")).startswith("sha256:")
    with pytest.raises(ValueError, match="JSON path"):
        ids.from_body_key("a..b")


def test_coordinates_catch_redeliveries_only(sqlite_engine: Engine) -> None:
    def publish(broker: InMemoryBroker) -> None:
        broker.publish("orders", body(1))
        broker.publish("orders", body(1))  # the producer sent it twice: a new offset

    consume(sqlite_engine, ids.from_coordinates, publish)
    # the same records again (a redelivery after a crash, a replay): same coordinates
    consume(sqlite_engine, ids.from_coordinates, publish)
    # two records, each applied once although each came twice; the producer's second
    # send is NOT caught (two rows for one order)
    assert order_counts(sqlite_engine) == {"orders/0/0": 1, "orders/0/1": 1}


def test_a_content_hash_makes_identical_bodies_one_message(sqlite_engine: Engine) -> None:
    def publish(broker: InMemoryBroker) -> None:
        broker.publish("orders", body(1))
        broker.publish("orders", body(1))  # identical bytes: one message
        broker.publish("orders", body(1, at="10:00"))  # the same fact, other bytes: two

    consume(sqlite_engine, ids.from_content_hash, publish)
    assert sorted(order_counts(sqlite_engine).values()) == [1, 1]
