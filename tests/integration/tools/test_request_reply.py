"""Request/reply over a real RabbitMQ: duplicate requests get identical replies."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pika
import pytest
from sqlalchemy import insert

from mqdedup import Consumer, InMemoryBroker, Message, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError, SimulatedCrash
from mqdedup.rabbitmq.replies import (
    REQUEST_ID_HEADER,
    RequestReplyConsumer,
    reply_message_id,
)
from mqdedup.rabbitmq.topology import declare_topology
from mqdedup.stopping import StopToken
from tests.integration.tools.conftest import Database
from tests.services import RabbitAdmin, unique_name, wait_for

pytestmark = pytest.mark.integration


@dataclass
class Reply:
    body: bytes
    properties: Any


@dataclass
class Client:
    """A requester with its own exclusive reply queue (as RPC clients have)."""

    url: str
    connection: Any = None
    channel: Any = None
    reply_queue: str = ""
    replies: list[Reply] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.connection = pika.BlockingConnection(pika.URLParameters(self.url))
        self.channel = self.connection.channel()
        declared = self.channel.queue_declare(queue="", exclusive=True)
        self.reply_queue = declared.method.queue

    def declare(self, consumer: RequestReplyConsumer) -> None:
        """Declare the consumer's queue (and DLQ) before requests are sent to it."""
        declare_topology(self.channel, consumer.topology())

    def request(self, queue: str, body: dict[str, Any], request_id: str, correlation: str) -> None:
        self.channel.basic_publish(
            exchange="",
            routing_key=queue,
            body=json.dumps(body).encode(),
            properties=pika.BasicProperties(
                message_id=request_id,
                correlation_id=correlation,
                reply_to=self.reply_queue,
                delivery_mode=2,
            ),
        )

    def wait_replies(self, count: int, timeout: float = 30) -> list[Reply]:
        def enough() -> bool:
            while True:
                method, properties, body = self.channel.basic_get(self.reply_queue, auto_ack=True)
                if method is None:
                    return len(self.replies) >= count
                self.replies.append(Reply(body, properties))

        wait_for(enough, timeout, f"{count} replies")
        return self.replies

    def close(self) -> None:
        self.connection.close()


@pytest.fixture
def client(rabbitmq_url: str) -> Iterator[Client]:
    requester = Client(rabbitmq_url)
    yield requester
    requester.close()


@pytest.fixture
def queue(rabbit: RabbitAdmin) -> Iterator[str]:
    name = unique_name("rpc")
    yield name
    rabbit.delete(name, f"{name}.dlq")


def quote_consumer(db: Database, queue: str, url: str) -> type[RequestReplyConsumer]:
    orders = db.business.orders

    class Quotes(RequestReplyConsumer):
        batch_size = 50
        poll_timeout = 0.3
        table_prefix = db.prefix
        calls: Counter[str]

        def respond(self, message: Message, ctx: Context) -> Any:
            self.calls[str(message.id)] += 1
            request = message.json()
            ctx.session.execute(
                insert(orders).values(message_id=message.id, order_id=str(request["item"]))
            )
            # Keys deliberately unsorted and nested: PostgreSQL's JSONB stores them in
            # its own order, and the re-sent reply must still be byte-identical.
            return {
                "zeta": [3, 1, 2],
                "price": 12.5,
                "item": request["item"],
                "α": {"b": 1, "a": 2},
            }

    Quotes.queue = queue
    Quotes.url = url
    Quotes.calls = Counter()
    return Quotes


class Running:
    """A consumer's ``run`` in a thread, stopped (and joined) on exit."""

    def __init__(self, consumer: RequestReplyConsumer, db: Database) -> None:
        self.stop = StopToken()
        self.metrics = Metrics()
        self.error: BaseException | None = None
        self.consumer = consumer

        def run() -> None:
            try:
                consumer.run(db.engine, stop=self.stop, metrics=self.metrics)
            except BaseException as error:
                self.error = error

        self.thread = threading.Thread(target=run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.request()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


def test_same_request_3_times_gets_3_identical_replies_and_one_handler_run(
    pg: Database, rabbitmq_url: str, client: Client, queue: str
) -> None:
    consumer_class = quote_consumer(pg, queue, rabbitmq_url)
    consumer = consumer_class()
    client.declare(consumer)
    # Two copies waiting before the consumer starts: they arrive in one batch (a repeat
    # inside the batch); the third comes after the answers (a duplicate of a stored claim).
    client.request(queue, {"item": "lamp"}, "req-1", "corr-1")
    client.request(queue, {"item": "lamp"}, "req-1", "corr-1")
    with Running(consumer, pg) as running:
        client.wait_replies(2)
        client.request(queue, {"item": "lamp"}, "req-1", "corr-1")
        replies = client.wait_replies(3)
        wait_for(
            lambda: running.metrics.processed + running.metrics.duplicates >= 3,
            30,
            "the three requests to be settled",
        )
    assert running.error is None

    assert len(replies) == 3
    assert len({reply.body for reply in replies}) == 1  # byte-identical bodies
    assert json.loads(replies[0].body) == {
        "zeta": [3, 1, 2],
        "price": 12.5,
        "item": "lamp",
        "α": {"b": 1, "a": 2},
    }
    assert {r.properties.correlation_id for r in replies} == {"corr-1"}
    assert {r.properties.message_id for r in replies} == {reply_message_id(queue, "req-1")}
    assert {r.properties.headers[REQUEST_ID_HEADER] for r in replies} == {"req-1"}
    assert consumer_class.calls == {"req-1": 1}  # the handler ran once
    assert pg.business.order_counts(pg.engine) == {"req-1": 1}
    assert (running.metrics.processed, running.metrics.duplicates) == (1, 2)
    assert consumer.replies_sent == 3


def test_crash_after_the_reply_before_the_ack_resends_the_stored_reply(
    pg: Database, rabbitmq_url: str, client: Client, queue: str
) -> None:
    """The worker dies after committing and replying, before acking: the redelivered
    requests are duplicates and each gets its stored reply again, byte-identical."""
    consumer_class = quote_consumer(pg, queue, rabbitmq_url)

    class CrashesBeforeAck(consumer_class):  # type: ignore[misc,valid-type]
        def after_commit(self, messages: Sequence[Message]) -> None:
            super().after_commit(messages)  # the replies are out
            raise SimulatedCrash("killed after the replies, before the acks")

    crashing = CrashesBeforeAck()
    client.declare(crashing)
    for number in range(5):
        client.request(queue, {"item": f"item-{number}"}, f"req-{number}", f"corr-{number}")
    crashed = Running(crashing, pg)
    with crashed:
        wait_for(lambda: crashed.error is not None, 30, "the worker to crash")
    assert isinstance(crashed.error, SimulatedCrash)
    first = list(client.wait_replies(crashing.replies_sent))
    assert 1 <= len(first) <= 5

    survivor = consumer_class()
    with Running(survivor, pg) as running:
        client.wait_replies(len(first) + 5)
        wait_for(
            lambda: running.metrics.processed + running.metrics.duplicates >= 5,
            30,
            "the redelivered requests to be settled",
        )
    assert running.error is None

    by_request: dict[str, set[bytes]] = {}
    for reply in client.replies:
        by_request.setdefault(reply.properties.headers[REQUEST_ID_HEADER], set()).add(reply.body)
    assert set(by_request) == {f"req-{n}" for n in range(5)}
    assert all(len(bodies) == 1 for bodies in by_request.values())  # identical per request
    assert set(consumer_class.calls.values()) == {1}  # no handler ran twice
    assert len(consumer_class.calls) == 5
    assert pg.business.order_counts(pg.engine) == {f"req-{n}": 1 for n in range(5)}
    assert running.metrics.duplicates == len(first)  # the crashed batch came back


def test_repeats_inside_one_batch_get_the_stored_result(pg: Database) -> None:
    """The processor hands every copy in a batch to on_duplicate with the first's result."""
    seen: list[tuple[str, Any]] = []
    orders = pg.business.orders

    class Orders(Consumer):
        name = "orders"
        poll_timeout = 0.05
        table_prefix = pg.prefix

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id))
            return {"accepted": message.id}

        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            seen.append((str(message.id), stored_result))

    broker = InMemoryBroker()
    for _ in range(3):
        broker.publish("orders", b"{}", message_id="a")
    metrics = run_until_idle(Orders(), broker.transport("orders"), pg.engine)
    assert (metrics.batches, metrics.processed, metrics.duplicates) == (1, 1, 2)
    assert seen == [("a", {"accepted": "a"}), ("a", {"accepted": "a"})]
    assert pg.business.order_counts(pg.engine) == {"a": 1}


def test_reply_consumers_implement_respond_not_handle() -> None:
    class Wrong(RequestReplyConsumer):
        queue = "q"

        def handle(self, message: Message, ctx: Context) -> Any:
            return None

    with pytest.raises(ConfigurationError, match="implements respond"):
        Wrong().validate()
