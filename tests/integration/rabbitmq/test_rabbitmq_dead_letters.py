"""RabbitMQ poison messages: retried, dead-lettered with reasons, requeued, processed once."""

from __future__ import annotations

import json
import threading
from typing import ClassVar

import pika
import pytest

from mqdedup import Message, RetryPolicy
from mqdedup.rabbitmq.consumer import requeue_dead_letters
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import (
    ThreadedWorker,
    attempts,
    claims,
    make_consumer,
    order_counts,
)
from tests.services import RabbitAdmin, wait_for

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.1)


class Switch:
    """The handler's bug: on while ``broken`` is set."""

    broken: ClassVar[bool] = True


def fails_on_poison(message: Message) -> None:
    if message.id == "poison" and Switch.broken:
        raise ValueError("cannot parse order: amount is not a number")


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_poison_message_is_dead_lettered_with_reasons_then_requeued_and_processed_once(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str, queue_type: str
) -> None:
    Switch.broken = True
    ids = [f"p{number:02d}" for number in range(19)] + ["poison"]
    consumer_class = make_consumer(
        queue,
        db.prefix,
        rabbitmq_url,
        batch_size=10,
        queue_type=queue_type,
        retry_policy=FAST_RETRY,
        before_write=fails_on_poison,
    )
    consumer = consumer_class()
    broker.declare(consumer)
    poison_body = b'{"order": 7, "amount": "seven"}'
    broker.publish(
        queue,
        ids,
        body=lambda i: poison_body if i == "poison" else json.dumps({"id": i}).encode(),
        properties=lambda i: {
            "content_type": "application/json",
            "correlation_id": f"corr-{i}",
            "expiration": "600000",
            "headers": {"tenant": "acme", "priority-class": 2},
        },
    )
    dlq = f"{queue}.dlq"

    with ThreadedWorker(consumer, db.engine) as worker:
        wait_for(
            lambda: broker.depth(dlq) == 1 and len(order_counts(db.engine, db.orders)) == 19,
            60,
            "19 orders and one dead letter",
        )
        metrics = worker.finish()

    assert consumer.calls["poison"] == 3, "retried up to max_attempts"
    assert (metrics.dead_lettered, metrics.processed) == (1, 19)
    assert attempts(db.engine, db.prefix, queue, "poison") == 3
    assert "poison" not in claims(db.engine, db.prefix, queue), "failed: not marked processed"
    assert "poison" not in order_counts(db.engine, db.orders), "its writes rolled back"
    assert broker.depth(queue) == 0, "the original was acked after the copy was confirmed"

    [(properties, body)] = broker.peek_all(dlq)
    assert body == poison_body
    assert properties.message_id == "poison"
    assert properties.content_type == "application/json"
    assert properties.correlation_id == "corr-poison"
    assert properties.delivery_mode == 2
    assert properties.expiration is None, "a dead letter must not expire"
    headers = properties.headers
    assert headers["tenant"] == "acme" and headers["priority-class"] == 2  # originals kept
    assert headers["x-mqdedup-error-class"] == "builtins.ValueError"
    assert headers["x-mqdedup-error-message"] == "cannot parse order: amount is not a number"
    assert headers["x-mqdedup-consumer"] == queue
    assert headers["x-mqdedup-source-queue"] == queue
    assert headers["x-mqdedup-attempts"] == "3"
    assert headers["x-mqdedup-message-id"] == "poison"
    assert headers["x-mqdedup-original-expiration"] == "600000"
    assert "ValueError" in headers["x-mqdedup-reason"]

    # The handler is fixed; the requeue helper moves the message back (and resets attempts).
    Switch.broken = False
    result = consumer.requeue_dead_letters(database=db.engine)
    assert (result.moved, result.skipped, result.remaining) == (1, 0, 0)
    assert broker.depth(dlq) == 0
    assert attempts(db.engine, db.prefix, queue, "poison") is None

    fixed = consumer_class()
    with ThreadedWorker(fixed, db.engine) as worker:
        wait_for(lambda: "poison" in order_counts(db.engine, db.orders), 60, "the poison order")
        broker.publish(queue, ["poison"], body=lambda _: poison_body, wait=False)  # a resend
        wait_for(lambda: fixed.duplicate_ids == ["poison"], 60, "the resend to be skipped")
        metrics = worker.finish()

    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}, "exactly once"
    assert (metrics.processed, metrics.duplicates, metrics.dead_lettered) == (1, 1, 0)
    assert fixed.calls["poison"] == 1
    assert broker.depth(queue) == 0 and broker.depth(dlq) == 0


def test_attempts_are_counted_across_redeliveries_and_workers(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    """Attempt 1 in one worker, attempts 2 and 3 in the next: dead-lettered after 3 in all."""
    Switch.broken = True
    slow_retry = RetryPolicy(max_attempts=3, initial_backoff=30.0, max_backoff=30.0)
    first = make_consumer(
        queue, db.prefix, rabbitmq_url, retry_policy=slow_retry, before_write=fails_on_poison
    )()
    broker.declare(first)
    broker.publish(queue, ["a", "poison", "b"])
    with ThreadedWorker(first, db.engine) as worker:
        wait_for(
            lambda: attempts(db.engine, db.prefix, queue, "poison") == 1,
            60,
            "the first failed attempt to be recorded",
        )
        worker.finish()  # stops during the 30 s backoff: poison stays unsettled
    assert first.calls["poison"] == 1
    assert broker.depth(f"{queue}.dlq") == 0
    wait_for(lambda: broker.depth(queue) == 1, 30, "poison back in the queue")

    second = make_consumer(
        queue, db.prefix, rabbitmq_url, retry_policy=FAST_RETRY, before_write=fails_on_poison
    )()
    with ThreadedWorker(second, db.engine) as worker:
        wait_for(lambda: broker.depth(f"{queue}.dlq") == 1, 60, "the dead letter")
        worker.finish()
    assert second.calls["poison"] == 2, "2 more runs, 3 in total"
    [(properties, _)] = broker.peek_all(f"{queue}.dlq")
    assert properties.headers["x-mqdedup-attempts"] == "3"
    assert order_counts(db.engine, db.orders) == {"a": 1, "b": 1}


def test_requeue_helper_moves_all_or_n_and_loses_none(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    consumer = make_consumer(queue, db.prefix, rabbitmq_url)()
    broker.declare(consumer)
    dlq = f"{queue}.dlq"
    channel = broker.channel()
    for number in range(30):
        headers = {"x-mqdedup-source-queue": queue, "x-mqdedup-reason": "test", "keep": "yes"}
        if number == 29:
            headers = {"keep": "orphan"}  # no source queue: must stay in the DLQ
        channel.basic_publish(
            "",
            dlq,
            f"body-{number}".encode(),
            pika.BasicProperties(message_id=f"d{number:02d}", delivery_mode=2, headers=headers),
        )
    wait_for(lambda: broker.depth(dlq) == 30, 30, "30 dead letters")

    some = requeue_dead_letters(rabbitmq_url, dead_letter_queue=dlq, limit=10)
    assert (some.moved, some.skipped) == (10, 0)
    wait_for(lambda: broker.depth(queue) == 10, 30, "10 moved")
    assert broker.depth(dlq) == 20

    rest = requeue_dead_letters(rabbitmq_url, dead_letter_queue=dlq)
    assert (rest.moved, rest.skipped, rest.remaining) == (19, 1, 1)
    wait_for(lambda: broker.depth(queue) == 29, 30, "29 moved")
    [(orphan, _)] = broker.peek_all(dlq)
    assert orphan.headers == {"keep": "orphan"}

    moved = broker.peek_all(queue)
    assert sorted(p.message_id for p, _ in moved) == [f"d{n:02d}" for n in range(29)]
    assert {body for _, body in moved} == {f"body-{n}".encode() for n in range(29)}
    for properties, _ in moved:
        assert properties.headers["keep"] == "yes"
        assert properties.headers["x-mqdedup-requeued"] == 1
        assert "x-mqdedup-reason" not in properties.headers
        assert "x-mqdedup-source-queue" not in properties.headers


def test_requeue_to_a_missing_queue_keeps_the_message(
    broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    dlq = f"{queue}.dlq"
    broker.channel().queue_declare(dlq, durable=True)
    broker.channel().basic_publish(
        "",
        dlq,
        b"x",
        pika.BasicProperties(
            message_id="lost?", headers={"x-mqdedup-source-queue": f"{queue}-does-not-exist"}
        ),
    )
    wait_for(lambda: broker.depth(dlq) == 1, 30, "the dead letter")
    from mqdedup.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="no such queue"):
        requeue_dead_letters(rabbitmq_url, dead_letter_queue=dlq)
    wait_for(lambda: broker.depth(dlq) == 1, 30, "the dead letter back in place")


def test_concurrent_requeue_and_consume_never_loses_a_message(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    """Requeue while the worker runs: every dead letter ends processed exactly once."""
    Switch.broken = True
    consumer_class = make_consumer(
        queue, db.prefix, rabbitmq_url, batch_size=20, retry_policy=FAST_RETRY
    )
    consumer = consumer_class()
    broker.declare(consumer)
    dlq = f"{queue}.dlq"
    ids = [f"q{number:03d}" for number in range(200)]
    broker.publish(
        dlq,
        ids,
        properties=lambda _: {"headers": {"x-mqdedup-source-queue": queue}},
    )
    with ThreadedWorker(consumer, db.engine) as worker:
        mover = threading.Thread(
            target=lambda: requeue_dead_letters(rabbitmq_url, dead_letter_queue=dlq)
        )
        mover.start()
        mover.join(60)
        wait_for(
            lambda: len(order_counts(db.engine, db.orders)) == 200 and broker.depth(queue) == 0,
            60,
            "all 200 requeued messages processed",
        )
        worker.finish()
    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == ids and set(counts.values()) == {1}
    assert broker.depth(dlq) == 0
