"""The outbox against real PostgreSQL, Kafka and RabbitMQ: transactions, order, wake-up."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from sqlalchemy import insert
from sqlalchemy.orm import Session

from mqdedup import InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import Context
from mqdedup.errors import ConfigurationError
from mqdedup.kafka import KafkaPublisher
from mqdedup.outbox import MemoryPublisher, OutboxWriter, Relay, RelayConfig
from mqdedup.outbox.relay_coordination import SharedShards
from mqdedup.outbox.writer import outgoing_message_id
from mqdedup.rabbitmq import RabbitMQPublisher
from tests.integration.outbox.helpers import (
    OutboxDb,
    RelayProcess,
    order_problems,
    poll_until,
    relay_thread,
    write_keyed_rows,
)
from tests.services import KafkaHelper, RabbitAdmin, kafka_headers

pytestmark = pytest.mark.integration


def forwarding_consumer(db: OutboxDb, topic: str, fail_ids: set[str]) -> Consumer:
    """Writes a business row and forwards the message to ``topic``; fails for ``fail_ids``."""

    class Forwarder(Consumer):
        name = "forwarder"
        table_prefix = db.prefix
        poll_timeout = 0.05
        retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(
                insert(db.events).values(consumer="forwarder", message_id=message.id)
            )
            ctx.outbox.publish(message.json(), topic=topic, key=message.id)
            if message.id in fail_ids:
                raise RuntimeError("the handler fails after writing both rows")
            return None

    return Forwarder()


def test_failing_handler_leaves_no_business_row_no_outbox_row_and_publishes_nothing(
    db: OutboxDb, kafka_helper: KafkaHelper, kafka_bootstrap: str
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    broker = InMemoryBroker()
    broker.publish("in", json.dumps({"n": 1}), message_id="good")
    broker.publish("in", json.dumps({"n": 2}), message_id="bad")

    consumer = forwarding_consumer(db, topic, {"bad"})
    metrics = run_until_idle(consumer, broker.transport("in"), db.engine)
    good_out = outgoing_message_id("forwarder", "good", 0)
    assert db.outbox_ids() == {good_out}  # no outbox row for "bad"
    relay = Relay(db.engine, {"kafka": KafkaPublisher(kafka_bootstrap)}, prefix=db.prefix)
    relay.drain(timeout=60)
    relay.close()

    assert (metrics.processed, metrics.dead_lettered) == (1, 1)
    assert db.event_counts("forwarder") == {"good": 1}  # no business row for "bad"
    assert db.status().published == 1
    records = kafka_helper.read_all(topic, expected=1, timeout=30)
    assert [kafka_headers(r)["message-id"] for r in records] == [good_out]  # nothing else
    assert kafka_headers(records[0])["causation-id"] == "good"
    assert json.loads(records[0].value) == {"n": 1}
    assert records[0].key == b"good"


@pytest.mark.parametrize("target", ["kafka", "rabbitmq"])
def test_10k_rows_from_concurrent_transactions_are_published_once_in_key_order(
    db: OutboxDb,
    kafka_helper: KafkaHelper,
    rabbit: RabbitAdmin,
    kafka_bootstrap: str,
    rabbitmq_url: str,
    target: str,
) -> None:
    if target == "kafka":
        topic = kafka_helper.create_topic(partitions=4)
        destination: dict[str, Any] = {"topic": topic}
        publisher: Any = KafkaPublisher(kafka_bootstrap)
    else:
        queue = rabbit.queue()
        destination = {"exchange": "", "routing_key": queue}
        publisher = RabbitMQPublisher(rabbitmq_url)
    relay = Relay(db.engine, {target: publisher}, prefix=db.prefix)

    with relay_thread(relay) as (_, result):  # publishing while transactions still commit
        written = write_keyed_rows(db, destination, keys=200, per_key=50, threads=8)
        poll_until(lambda: db.status().pending == 0, 120, "every row published")
    metrics = result[0]

    all_ids = [message_id for ids in written.values() for message_id in ids]
    assert len(all_ids) == len(set(all_ids)) == 10_000
    if target == "kafka":
        records = kafka_helper.read_all(topic, expected=10_000)
        delivered = [kafka_headers(r)["message-id"] for r in records]
        payloads = [json.loads(r.value) for r in records]  # partition by partition
    else:
        messages = rabbit.drain(queue, expected=10_000)
        delivered = [properties.message_id for properties, _ in messages]
        payloads = [json.loads(body) for _, body in messages]
    assert len(delivered) == 10_000, "each row published exactly once"
    assert set(delivered) == set(all_ids)
    assert order_problems([(p["key"], p["seq"]) for p in payloads]) == []
    status = db.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 10_000)
    assert metrics.published == 10_000 and metrics.failed == 0


def test_notify_wakes_the_relay_long_before_its_poll_interval(
    db: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    queue = rabbit.queue()
    relay = Relay(
        db.engine,
        {"rabbitmq": RabbitMQPublisher(rabbitmq_url)},
        prefix=db.prefix,
        config=RelayConfig(poll_interval=60.0),  # only a notification can wake it in time
    )
    with relay_thread(relay):
        poll_until(
            lambda: (
                relay.metrics.batches == 0
                and isinstance(relay.coordination, SharedShards)
                and bool(relay.coordination.coordinator.owned)
            ),
            30,
            "the relay to own its shards",
        )
        latencies = []
        for number in range(5):
            committed = time.monotonic()
            with Session(db.engine) as session, session.begin():
                OutboxWriter(session, prefix=db.prefix).publish(
                    {"n": number}, exchange="", routing_key=queue
                )
            poll_until(lambda n=number: rabbit.depth(queue) == n + 1, 10, "the message")
            latencies.append(time.monotonic() - committed)
    assert max(latencies) < 2.0, latencies  # the poll interval is 60 s


def test_rolled_back_savepoint_and_transaction_publish_nothing(
    db: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    queue = rabbit.queue()
    with Session(db.engine) as session:
        with session.begin():
            writer = OutboxWriter(session, prefix=db.prefix)
            kept = writer.publish(b"kept", exchange="", routing_key=queue)
            savepoint = session.begin_nested()
            writer.publish(b"undone by the savepoint", exchange="", routing_key=queue)
            savepoint.rollback()
        session.begin()
        writer = OutboxWriter(session, prefix=db.prefix)
        writer.publish(b"rolled back", exchange="", routing_key=queue)
        session.rollback()
    relay = Relay(db.engine, {"rabbitmq": RabbitMQPublisher(rabbitmq_url)}, prefix=db.prefix)
    relay.drain(timeout=30)
    relay.close()
    messages = rabbit.drain(queue, expected=1, timeout=5)
    assert [(p.message_id, body) for p, body in messages] == [(kept, b"kept")]


def test_unroutable_and_missing_exchange_rows_fail_after_their_attempts_and_can_be_retried(
    db: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    queue = rabbit.queue()
    with Session(db.engine) as session, session.begin():
        writer = OutboxWriter(session, prefix=db.prefix)
        ok = writer.publish(b"ok", exchange="", routing_key=queue)
        unroutable = writer.publish(b"no queue", exchange="", routing_key=queue + "-missing")
        no_exchange = writer.publish(b"no exchange", exchange=queue + "-x", routing_key="r")
    relay = Relay(
        db.engine,
        {"rabbitmq": RabbitMQPublisher(rabbitmq_url)},
        prefix=db.prefix,
        config=RelayConfig(max_attempts=2, initial_backoff=0.05, max_backoff=0.05),
    )
    try:
        poll_until(
            lambda: relay.run_once() is not None and db.status().failed == 2,
            30,
            "two failed rows",
        )
        status = db.status()
        assert (status.published, status.failed, status.pending) == (1, 2, 0)
        assert [p.message_id for p, _ in rabbit.drain(queue, 1, 5)] == [ok]

        rabbit.channel().queue_declare(queue + "-missing", durable=True)  # the operator's fix
        rabbit.created.append(queue + "-missing")
        assert relay.retry_failed(destination="") == 1
        relay.drain(timeout=30)
        [(properties, body)] = rabbit.drain(queue + "-missing", 1, 10)
        assert (properties.message_id, body) == (unroutable, b"no queue")
        assert db.status().failed == 1  # the missing exchange is still failed, not lost
        assert no_exchange not in {p.message_id for p, _ in rabbit.drain(queue, 0, 1)}
    finally:
        relay.close()


def test_two_relays_at_once_publish_each_row_once_in_key_order(
    db: OutboxDb, kafka_helper: KafkaHelper, kafka_bootstrap: str
) -> None:
    topic = kafka_helper.create_topic(partitions=4)
    config = {
        "database_url": db.url,
        "prefix": db.prefix,
        "kafka": kafka_bootstrap,
        "batch_size": 100,
        "rebalance_interval": 0.3,
        "poll_interval": 0.2,
    }
    first = RelayProcess(config)
    second = RelayProcess(config)
    try:
        first.wait_for_line("STARTED", 30)
        second.wait_for_line("STARTED", 30)
        written = write_keyed_rows(db, {"topic": topic}, keys=120, per_key=50, threads=6)
        poll_until(lambda: db.status().pending == 0, 120, "every row published")
    finally:
        metrics = [first.stop(), second.stop()]

    records = kafka_helper.read_all(topic, expected=6_000)
    delivered = [kafka_headers(r)["message-id"] for r in records]
    assert len(delivered) == len(set(delivered)) == 6_000, "no row published twice"
    assert set(delivered) == {i for ids in written.values() for i in ids}
    payloads = [json.loads(r.value) for r in records]
    assert order_problems([(p["key"], p["seq"]) for p in payloads]) == []
    assert [m["published"] > 0 for m in metrics] == [True, True], metrics  # both worked
    assert sum(m["published"] for m in metrics) == 6_000


def test_relays_that_disagree_on_shards_refuse_to_run_side_by_side(db: OutboxDb) -> None:
    first = Relay(db.engine, {"kafka": MemoryPublisher()}, prefix=db.prefix)
    second = Relay(
        db.engine, {"kafka": MemoryPublisher()}, prefix=db.prefix, config=RelayConfig(shards=8)
    )
    try:
        first.run_once()
        with pytest.raises(ConfigurationError, match="different shards or publishers"):
            second.run_once()
    finally:
        first.close()
        second.close()
