"""The outbox writer on SQLite: rows, ids, headers, validation, transactions."""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session

from mqdedup import InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from mqdedup.outbox import InvalidOutgoingMessageError, OutboxWriter, OutgoingMessage
from mqdedup.outbox.writer import outgoing_message_id, shard_hash
from tests.support import OrderConsumer, order_counts, orders

OUTBOX = schema().outbox


def outbox_rows(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(connection.execute(select(OUTBOX).order_by(OUTBOX.c.id)).all())


def test_a_consumer_writer_derives_the_same_ids_on_every_run(sqlite_engine: Engine) -> None:
    ids = []
    for _ in range(2):  # the second run is a rerun of the same handler: same ids
        with Session(sqlite_engine) as session, session.begin():
            writer = OutboxWriter(session, consumer_name="billing", causation_id="in-1")
            ids.append([writer.publish({"n": n}, topic="invoices") for n in range(3)])
            session.rollback()

    assert ids[0] == ids[1]
    assert len(set(ids[0])) == 3
    assert ids[0][0] == outgoing_message_id("billing", "in-1", 0)
    assert outgoing_message_id("billing", "in-2", 0) != ids[0][0]
    assert outgoing_message_id("shipping", "in-1", 0) != ids[0][0]


def test_a_writer_outside_a_consumer_uses_time_ordered_uuids(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session)
        first = writer.publish(b"a", topic="t")
        second = writer.publish(b"a", topic="t")
        given = writer.publish(b"a", topic="t", message_id="order-7-created")

    assert first != second
    assert uuid.UUID(first).version == 7 and first < second  # UUIDv7, monotonic
    assert given == "order-7-created"
    assert [row.message_id for row in outbox_rows(sqlite_engine)] == [first, second, given]


def test_kafka_row_holds_topic_key_payload_and_id_headers(sqlite_engine: Engine) -> None:
    incoming = Message(
        body=b"{}",
        id="in-9",
        headers={"traceparent": "00-abc-def-01", "tracestate": "k=v"},
    )
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session, consumer_name="c", causation_id="in-9", message=incoming)
        message_id = writer.publish(
            {"order": 7}, topic="orders", key="order-7", headers={"tenant": "acme", "v": 2}
        )

    [row] = outbox_rows(sqlite_engine)
    assert (row.broker, row.destination, row.routing_key) == ("kafka", "orders", None)
    assert row.message_key == b"order-7"
    assert json.loads(row.payload) == {"order": 7}
    assert row.headers == {
        "message-id": message_id,
        "causation-id": "in-9",
        "traceparent": "00-abc-def-01",
        "tracestate": "k=v",
        "tenant": "acme",
        "v": 2,
    }
    assert row.properties is None
    assert (row.state, row.attempts) == ("pending", 0)
    assert row.shard_hash == shard_hash(b"order-7", message_id)


def test_rabbitmq_row_holds_exchange_routing_key_and_message_id_property(
    sqlite_engine: Engine,
) -> None:
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session, consumer_name="c", causation_id="in-1")
        json_id = writer.publish(
            {"a": 1},
            exchange="billing",
            routing_key="invoice.created",
            properties={"correlation_id": "corr-1", "priority": 5},
            traceparent="00-trace-span-01",
        )
        raw_id = writer.publish("plain text", exchange="", routing_key="audit")

    json_row, raw_row = outbox_rows(sqlite_engine)
    assert (json_row.broker, json_row.destination, json_row.routing_key) == (
        "rabbitmq",
        "billing",
        "invoice.created",
    )
    assert json_row.properties == {
        "correlation_id": "corr-1",
        "priority": 5,
        "message_id": json_id,
        "content_type": "application/json",
    }
    assert json_row.headers["traceparent"] == "00-trace-span-01"
    assert raw_row.payload == b"plain text"
    assert raw_row.properties == {"message_id": raw_id}


def test_publish_many_writes_all_rows_and_cause_sets_ids_per_message(
    sqlite_engine: Engine,
) -> None:
    first = Message(body=b"", id="m1", headers={"traceparent": "00-one-01"})
    second = Message(body=b"", id="m2")
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session, consumer_name="batch", causation_id="m1")
        ids = writer.publish_many(
            [
                OutgoingMessage(b"a", topic="t", cause=first),
                OutgoingMessage(b"b", topic="t", cause=second),
                OutgoingMessage(b"c", topic="t", cause=second),
            ]
        )

    assert ids == [
        outgoing_message_id("batch", "m1", 0),
        outgoing_message_id("batch", "m2", 0),
        outgoing_message_id("batch", "m2", 1),
    ]
    rows = outbox_rows(sqlite_engine)
    assert [row.headers.get("causation-id") for row in rows] == ["m1", "m2", "m2"]
    assert rows[0].headers["traceparent"] == "00-one-01"
    assert "traceparent" not in rows[1].headers


def test_delay_postpones_availability(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as session, session.begin():
        OutboxWriter(session).publish(b"x", topic="t", delay=30)
    [row] = outbox_rows(sqlite_engine)
    assert 29.9 < (row.available_at - row.created_at).total_seconds() < 30.1


def test_rolled_back_transaction_leaves_no_outbox_row(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as session:
        with session.begin():
            OutboxWriter(session).publish(b"kept", topic="t")
        session.begin()
        OutboxWriter(session).publish(b"dropped", topic="t")
        session.rollback()
    assert [row.payload for row in outbox_rows(sqlite_engine)] == [b"kept"]


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        ({}, "exactly one destination"),
        ({"topic": "t", "exchange": "x"}, "exactly one destination"),
        ({"topic": "t", "routing_key": "r"}, "routing_key is for RabbitMQ"),
        ({"topic": "t", "properties": {"priority": 1}}, "AMQP properties need"),
        ({"exchange": ""}, "default exchange"),
        ({"exchange": "x", "properties": {"delivery_mode": 1}}, "unsupported AMQP properties"),
        ({"exchange": "x", "properties": {"expiration": 60}}, "expiration"),
        ({"exchange": "x", "properties": {"priority": 300}}, "priority"),
        ({"topic": "t", "headers": {"h": b"\xff"}}, "not UTF-8"),
        ({"topic": "t", "headers": {"h": [1]}}, "must be str, bytes"),
        ({"exchange": "x", "headers": {"ratio": 0.5}}, "is a float"),
        ({"topic": "t", "headers": {"message-id": "x"}}, "set by mqdedup"),
        ({"topic": "t", "delay": -1}, "negative"),
        ({"topic": "t", "message_id": ""}, "message_id must be"),
        ({"topic": "t", "key": 5}, "key must be bytes or str"),
        ({"topic": ""}, "invalid Kafka topic"),
    ],
)
def test_bad_arguments_are_refused_with_a_clear_reason(
    sqlite_engine: Engine, arguments: dict[str, Any], complaint: str
) -> None:
    with (
        Session(sqlite_engine) as session,
        session.begin(),
        pytest.raises(InvalidOutgoingMessageError, match=complaint),
    ):
        OutboxWriter(session).publish(b"x", **arguments)


def test_payload_that_is_not_json_serialisable_is_refused(sqlite_engine: Engine) -> None:
    with (
        Session(sqlite_engine) as session,
        session.begin(),
        pytest.raises(InvalidOutgoingMessageError, match="JSON-serialisable"),
    ):
        OutboxWriter(session).publish(object(), topic="t")


class Forwarder(OrderConsumer):
    """Writes an order row and forwards an event through the outbox; fails on demand."""

    name = "forwarder"
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.01)
    fail_first: ClassVar[set[str]] = set()

    def handle(self, message: Message, ctx: Context) -> Any:
        payload = message.json()
        ctx.session.execute(insert(orders).values(message_id=message.id, order_id="x"))
        ctx.outbox.publish(payload, topic="events", key=str(payload["order"]))
        ctx.outbox.publish(payload, exchange="audit", routing_key="orders")
        if message.id in self.fail_first:
            self.fail_first.discard(str(message.id))
            raise RuntimeError("transient handler failure")
        return None


def test_handler_outbox_rows_commit_with_the_claim_and_reruns_reuse_ids(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker(seed=1)
    for number in range(20):
        broker.publish("in", json.dumps({"order": number}), message_id=f"m{number}")
    copies = broker.inject_duplicates("in", 0.5)
    consumer = Forwarder()
    consumer.fail_first = {"m3", "m7"}

    run_until_idle(consumer, broker.transport("in"), sqlite_engine)

    rows = outbox_rows(sqlite_engine)
    assert copies > 0
    assert len(order_counts(sqlite_engine)) == 20
    assert len(rows) == 40  # two per message, none for duplicates or failed attempts
    expected = {outgoing_message_id("forwarder", f"m{n}", seq) for n in range(20) for seq in (0, 1)}
    assert {row.message_id for row in rows} == expected
    with sqlite_engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(OUTBOX)).scalar_one() == 40


class FailingForwarder(Forwarder):
    name = "failing"
    retry_policy = RetryPolicy(max_attempts=1)

    def handle(self, message: Message, ctx: Context) -> Any:
        super().handle(message, ctx)
        raise RuntimeError("always fails")


def test_failing_handler_leaves_neither_business_row_nor_outbox_row(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    broker.publish("in", json.dumps({"order": 1}), message_id="m1")

    metrics = run_until_idle(FailingForwarder(), broker.transport("in"), sqlite_engine)

    assert metrics.dead_lettered == 1
    assert order_counts(sqlite_engine) == {}
    assert outbox_rows(sqlite_engine) == []
