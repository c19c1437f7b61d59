"""A RabbitMQ stream replay is a range transport run by the Worker and the shared Processor."""

from __future__ import annotations

import pika
import pytest

from mqdedup import Message, RetryPolicy
from mqdedup.rabbitmq.stream import StreamReplay
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import make_consumer, order_counts
from tests.services import RabbitAdmin

pytestmark = pytest.mark.integration


def declare_stream(broker: RabbitAdmin, name: str) -> None:
    channel = broker.channel()
    channel.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
    channel.confirm_delivery()  # each publish below returns once the stream holds it


def test_a_stream_replay_dead_letters_the_failing_message_and_processes_the_rest(
    broker: RabbitAdmin, db: Database, queue: str, rabbitmq_url: str
) -> None:
    declare_stream(broker, queue)
    ids = [f"s-{n}" for n in range(20)]
    broker.publish(queue, ids, wait=False)

    def fail(message: Message) -> None:
        if message.id == "s-7":
            raise ValueError("cannot handle s-7")

    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05)
    consumer = make_consumer(
        queue, db.prefix, rabbitmq_url, before_write=fail, retry_policy=policy, batch_size=6
    )
    report = StreamReplay(consumer(), db.engine).run()

    assert (report.new, report.duplicates, report.dead_lettered, report.unsettled) == (19, 0, 1, 0)
    assert report.ranges == {queue: (0, 20)}
    assert order_counts(db.engine, db.orders) == {mid: 1 for mid in ids if mid != "s-7"}
    dead = broker.peek_all(f"{queue}.dlq")
    assert len(dead) == 1
    properties, body = dead[0]
    assert body == b'{"id": "s-7"}'
    assert properties.headers["x-mqdedup-reason"] == (
        "handler failed after 2 attempts: ValueError: cannot handle s-7"
    )


def test_a_stream_replay_ends_at_the_stream_end_captured_when_it_started(
    broker: RabbitAdmin, db: Database, queue: str, rabbitmq_url: str
) -> None:
    """Each handled message appends one more to the stream: a replay that read until the
    stream went quiet would chase its own tail; this one stops after the first ten."""
    declare_stream(broker, queue)
    broker.publish(queue, [f"t-{n}" for n in range(10)], wait=False)
    more = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    channel = more.channel()
    channel.confirm_delivery()

    def append(message: Message) -> None:
        channel.basic_publish(
            "", queue, b"{}", pika.BasicProperties(message_id=f"more-{message.id}")
        )

    consumer = make_consumer(queue, db.prefix, rabbitmq_url, before_write=append, batch_size=3)
    try:
        report = StreamReplay(consumer(), db.engine).run()
    finally:
        more.close()

    assert (report.new, report.ranges) == (10, {queue: (0, 10)})
    again = StreamReplay(consumer(), db.engine, dry_run=True).run()
    assert (again.new, again.duplicates) == (10, 10)  # the appended ones are new
