"""The RabbitMQ dead-letter place: real dead letters in ``<queue>.dlq``, listed and shown
without leaving the queue, replayed (effects once, also twice), requeued and deleted."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from mqdedup import Message, RetryPolicy
from mqdedup.deadletters import group, replay
from mqdedup.errors import MessageError
from mqdedup.rabbitmq.dead_letter_queue import RabbitDeadLetterQueues
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import ThreadedWorker, make_consumer, order_counts
from tests.services import RabbitAdmin, wait_for

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.1)
FAILING = ("m1", "m3", "m4", "m5")


class Switch:
    broken: ClassVar[bool] = True


def refuses_some(message: Message) -> None:
    if Switch.broken and message.id in FAILING:
        raise MessageError(f"bad order {message.id}")


def test_rabbitmq_dead_letters_list_show_replay_requeue_and_delete(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    Switch.broken = True
    consumer_class = make_consumer(
        queue, db.prefix, rabbitmq_url, retry_policy=FAST_RETRY, before_write=refuses_some
    )
    consumer = consumer_class()
    broker.declare(consumer)
    ids = [f"m{n}" for n in range(7)]
    broker.publish(queue, ids, body=lambda i: json.dumps({"id": i}).encode())
    dlq = f"{queue}.dlq"
    with ThreadedWorker(consumer, db.engine) as worker:
        wait_for(lambda: broker.depth(dlq) == 4, 60, "four dead letters")
        worker.finish()
    place = RabbitDeadLetterQueues.for_consumer(consumer, db.engine)

    records = place.list()
    assert [r.message_id for r in records] == list(FAILING)
    assert broker.depth(dlq) == 4, "listing takes nothing away"
    assert [r.key for r in records] == [f"{dlq}:{m}" for m in FAILING]
    first = records[0]
    assert first.place == "rabbitmq" and first.consumer == queue and first.source == queue
    assert first.error.endswith("MessageError: bad order m1"), first.error
    assert first.body == b'{"id": "m1"}' and first.dead_lettered_at is not None
    assert first.message.properties["message_id"] == "m1"
    assert "x-mqdedup-reason" not in first.message.headers  # as its consumer gets it back
    assert len(group(records)) == 4
    assert place.get(first.key) == first and place.get(f"{dlq}:nope") is None
    assert place.list(limit=2) == records[:2]
    assert place.depth() == 4 and broker.depth(dlq) == 4

    Switch.broken = False
    outcome = replay(records[:2], consumer_class(), db.engine, place)
    assert (outcome.processed, outcome.duplicates, outcome.removed) == (2, 0, 2)
    assert order_counts(db.engine, db.orders) == {m: 1 for m in ids if m not in {"m4", "m5"}}
    assert broker.depth(dlq) == 2 and [r.message_id for r in place.list()] == ["m4", "m5"]

    again = replay(records[:2], consumer_class(), db.engine, place)  # gone from the DLQ
    assert (again.processed, again.duplicates, again.removed) == (0, 2, 0)
    assert order_counts(db.engine, db.orders)["m1"] == 1

    assert place.requeue([records[2].key]) == 1
    assert broker.depth(dlq) == 1 and broker.depth(queue) == 1
    [(properties, body)] = broker.peek_all(queue)
    assert properties.message_id == "m4" and body == b'{"id": "m4"}'
    assert "x-mqdedup-reason" not in (properties.headers or {})

    assert place.delete([records[3].key]) == 1
    assert place.delete([records[3].key]) == 0
    assert broker.depth(dlq) == 0 and place.list() == []


def test_a_list_while_another_reader_holds_messages_loses_none(
    db: Database, broker: RabbitAdmin, queue: str, rabbitmq_url: str
) -> None:
    Switch.broken = True
    consumer = make_consumer(
        queue, db.prefix, rabbitmq_url, retry_policy=FAST_RETRY, before_write=refuses_some
    )()
    broker.declare(consumer)
    broker.publish(queue, list(FAILING), body=lambda i: b"{}")
    dlq = f"{queue}.dlq"
    with ThreadedWorker(consumer, db.engine) as worker:
        wait_for(lambda: broker.depth(dlq) == 4, 60, "four dead letters")
        worker.finish()
    place = RabbitDeadLetterQueues.for_consumer(consumer, db.engine)
    holder = broker.channel()
    held, _, _ = holder.basic_get(dlq, auto_ack=False)  # a concurrent reader holds one
    assert held is not None

    seen = [r.message_id for r in place.list()]
    assert seen == ["m3", "m4", "m5"]  # the held one is invisible for the moment
    assert place.delete([f"{dlq}:m1"]) == 0  # held elsewhere: not found, not lost
    holder.close()  # the other reader lets go: back in the queue
    broker._channel = None
    wait_for(lambda: broker.depth(dlq) == 4, 30, "the held message back")
    assert sorted(r.message_id or "" for r in place.list()) == list(FAILING)
