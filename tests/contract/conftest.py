"""Kits that run the Transport and Publisher contract suites against every implementation.

A *kit* wraps one broker for the suites (watermill's ``Features`` + faststream's base
suite): it publishes raw messages into a fresh source, builds transports of a consumer of
that source, reads the dead-letter destination, tells how many messages are still
unsettled, and carries a :class:`Features` record of what its broker guarantees. The
suites in this folder only talk to kits, so a new adapter passes them by adding a kit
here (see ``tests/README.md``).

Kits: ``memory`` (``InMemoryBroker``), ``kafka`` (the shared Kafka, a fresh 2-partition
topic and group), ``rabbitmq`` (the shared RabbitMQ, a fresh queue and DLQ), and the
async consumers' transports ``async-kafka`` and ``async-rabbitmq`` over the same brokers
(the same kafka-python / pika transports, driven from an event loop by
``mqdedup.consumers.bridged_transport``): their methods run inside the greenlet bridge on
an event loop of the kit's own thread (:class:`OnLoop`), as in an async application.
"""

from __future__ import annotations

import abc
import asyncio
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
from sqlalchemy import Table, insert

from mqdedup import AsyncConsumer, Consumer, Context, Message
from mqdedup.bridge import run_bridged
from mqdedup.consumers.memory import InMemoryBroker
from mqdedup.consumers.transport import DeadLetter, Delivery, Transport
from mqdedup.outbox.memory import MemoryPublisher
from mqdedup.outbox.publishers import OutboxRecord, Publisher
from tests.services import (
    KafkaHelper,
    RabbitAdmin,
    TestDatabase,
    free_port,
    prefixed_database,
    table_prefix,
    unique_name,
    wait_for,
)
from tests.support import orders_table

#: Fast failure detection for the Kafka kit (the broker's minimum session timeout is 6 s)
#: and a short poll deadline, so that the keepalive test holds a batch past it in seconds.
KAFKA_POLL_DEADLINE = 1.5
KAFKA_CONFIG = {
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 1000,
    "max_poll_interval_ms": int(KAFKA_POLL_DEADLINE * 1000),
}


@dataclass(frozen=True)
class Features:
    """What a broker guarantees; the suites assert each promise only where it is made."""

    #: Where order is kept: within a ``partition`` (per key) or the whole ``queue``.
    ordering: Literal["partition", "queue"]
    #: Messages handed out again after a transport closed unsettled carry ``redelivered``.
    #: (Kafka: a graceful close is a clean hand-over, so they do not.)
    flags_redelivery: bool
    #: ``Message.key`` is the producer's key.
    keeps_key: bool
    #: Seconds the broker allows between polls before it drops the consumer (None: no
    #: such deadline); the keepalive test holds a batch longer than this.
    poll_deadline: float | None


@dataclass(frozen=True)
class Raw:
    """A message as a producer sends it into the source."""

    id: str
    body: bytes
    key: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeadLettered:
    """A message found in the dead-letter destination, decoded for assertions."""

    body: bytes
    message_id: str | None
    key: bytes | None
    headers: Mapping[str, str]


def text(value: Any) -> str:
    """A header value as text (brokers hand back bytes or str)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def raws(count: int, prefix: str = "m", keys: int = 3) -> list[Raw]:
    """``count`` messages with ids ``<prefix>000..``, ``keys`` keys and a test header."""
    return [
        Raw(
            id=f"{prefix}{n:03d}",
            body=json.dumps({"n": n, "key": f"k{n % keys}"}).encode(),
            key=f"k{n % keys}".encode(),
            headers={"x-test": f"value-{n}"},
        )
        for n in range(count)
    ]


class ContractOrders(Consumer):
    """The kits' consumers: one row per message in ``orders``; ``fail_ids`` always fail."""

    orders: ClassVar[Table]
    fail_ids: ClassVar[frozenset[str]] = frozenset()
    batch_size = 100
    poll_timeout = 0.2

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        if message.id in self.fail_ids:
            raise ValueError(f"cannot handle {message.id}")
        ctx.session.execute(insert(type(self).orders).values(message_id=message.id))
        return None


class AsyncContractOrders(AsyncConsumer):
    """:class:`ContractOrders` with ``async def handle`` (the asyncio kits' consumers)."""

    orders: ClassVar[Table]
    fail_ids: ClassVar[frozenset[str]] = frozenset()
    batch_size = 100
    poll_timeout = 0.2

    async def handle(self, message: Message, ctx: Any) -> Any:
        assert message.id is not None
        if message.id in self.fail_ids:
            raise ValueError(f"cannot handle {message.id}")
        await ctx.session.execute(insert(type(self).orders).values(message_id=message.id))
        return None


class TransportKit(abc.ABC):
    """One broker, as the Transport suite sees it."""

    name: ClassVar[str]
    features: ClassVar[Features]

    def __init__(self) -> None:
        self._transports: list[Transport] = []

    @abc.abstractmethod
    def publish(self, messages: Sequence[Raw]) -> None:
        """Put ``messages`` into the source, in order, and wait until the broker has them."""

    @abc.abstractmethod
    def consumer_class(self, **attributes: Any) -> type[ContractOrders]:
        """A consumer of the source (``attributes`` override its class attributes)."""

    @abc.abstractmethod
    def _open(self, consumer: ContractOrders) -> Transport:
        """A fresh transport of ``consumer``."""

    @abc.abstractmethod
    def remaining(self) -> int:
        """Messages not settled for good (what a new transport would get); call it
        when the kit's transports are closed."""

    @abc.abstractmethod
    def dead_letters(self, expected: int) -> list[DeadLettered]:
        """The dead-letter destination's messages (waits for ``expected`` of them)."""

    def transport(self, consumer: ContractOrders | None = None) -> Transport:
        """A fresh transport (closed at the end of the test if the test did not)."""
        opened = self._open(consumer or self.consumer_class()())
        self._transports.append(opened)
        return opened

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


def fetch(transport: Transport, count: int, timeout: float = 30.0) -> list[Delivery]:
    """Fetch until ``count`` deliveries came (fails after ``timeout`` seconds)."""
    found: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(found) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"fetched {len(found)} of {count} deliveries in {timeout}s")
        found.extend(transport.fetch(count - len(found), min(left, 1.0)))
    return found


def ids_of(kit_consumer: Consumer, deliveries: Sequence[Delivery]) -> list[str]:
    """The message ids of ``deliveries`` (the consumer's id strategy), in order."""
    return [kit_consumer.message_id(delivery.message) for delivery in deliveries]


# -- memory ----------------------------------------------------------------------------------


class MemoryKit(TransportKit):
    name = "memory"
    features = Features(ordering="queue", flags_redelivery=True, keeps_key=True, poll_deadline=None)

    def __init__(self) -> None:
        super().__init__()
        self.broker = InMemoryBroker(seed=7)
        self.queue = "contract"

    def publish(self, messages: Sequence[Raw]) -> None:
        for raw in messages:
            self.broker.publish(
                self.queue, raw.body, message_id=raw.id, key=raw.key, headers=dict(raw.headers)
            )

    def consumer_class(self, **attributes: Any) -> type[ContractOrders]:
        return type("MemoryOrders", (ContractOrders,), {"name": "contract", **attributes})

    def _open(self, consumer: ContractOrders) -> Transport:
        return self.broker.transport(self.queue)

    def remaining(self) -> int:
        return self.broker.pending(self.queue)

    def dead_letters(self, expected: int) -> list[DeadLettered]:
        found = self.broker.dead_letters.get(self.queue, [])
        assert len(found) >= expected, f"{len(found)} dead letters, expected {expected}"
        return [
            DeadLettered(
                body=item.message.body,
                message_id=item.message.header("message-id"),
                key=item.message.key,
                headers={
                    **{k: text(v) for k, v in item.message.headers.items()},
                    **item.record.headers(),
                },
            )
            for item in found
        ]


# -- Kafka -----------------------------------------------------------------------------------


class KafkaKit(TransportKit):
    name = "kafka"
    features = Features(
        ordering="partition",
        flags_redelivery=False,
        keeps_key=True,
        poll_deadline=KAFKA_POLL_DEADLINE,
    )

    def __init__(self, helper: KafkaHelper) -> None:
        super().__init__()
        self.helper = helper
        self.topic = helper.create_topic(partitions=2, kind="contract")
        self.group = unique_name("contract-group")

    def publish(self, messages: Sequence[Raw]) -> None:
        from tests.services import Outgoing

        self.helper.produce(
            self.topic,
            [
                Outgoing(
                    raw.id,
                    raw.body,
                    key=raw.key,
                    headers=tuple((k, v.encode()) for k, v in raw.headers.items()),
                )
                for raw in messages
            ],
        )

    def consumer_class(self, **attributes: Any) -> type[ContractOrders]:
        from mqdedup.kafka import KafkaConsumer

        namespace = {
            "topics": [self.topic],
            "group_id": self.group,
            "bootstrap_servers": self.helper.bootstrap,
            "kafka_config": KAFKA_CONFIG,
            "commit_interval": 0.0,
            **attributes,
        }
        return type("KafkaOrders", (ContractOrders, KafkaConsumer), namespace)

    def _open(self, consumer: ContractOrders) -> Transport:
        transport: Transport = consumer.create_transport()
        return transport

    def remaining(self) -> int:
        ends = self.helper.end_offsets(self.topic)
        committed = self.helper.committed(self.group, self.topic)
        return sum(end - (committed.get(p) or 0) for p, end in ends.items())

    def dead_letters(self, expected: int) -> list[DeadLettered]:
        records = self.helper.read_all(f"{self.topic}.DLT", expected, timeout=30)
        return [
            DeadLettered(
                body=record.value,
                message_id=text(dict(record.headers).get("message-id", b"")) or None,
                key=record.key,
                headers={name: text(value) for name, value in record.headers},
            )
            for record in records
        ]


# -- RabbitMQ --------------------------------------------------------------------------------


class RabbitMQKit(TransportKit):
    name = "rabbitmq"
    features = Features(
        ordering="queue", flags_redelivery=True, keeps_key=False, poll_deadline=None
    )

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.admin = RabbitAdmin(url)
        self.queue = unique_name("contract")
        self.admin.declare(self.consumer_class()())

    def publish(self, messages: Sequence[Raw]) -> None:
        import pika

        channel = self.admin.channel()
        before = self.admin.depth(self.queue)
        for raw in messages:
            channel.basic_publish(
                exchange="",
                routing_key=self.queue,
                body=raw.body,
                properties=pika.BasicProperties(
                    message_id=raw.id, headers=dict(raw.headers), delivery_mode=2
                ),
            )
        wait_for(
            lambda: self.admin.depth(self.queue) >= before + len(messages),
            30,
            f"{len(messages)} messages in {self.queue}",
        )

    def consumer_class(self, **attributes: Any) -> type[ContractOrders]:
        from mqdedup.rabbitmq import RabbitMQConsumer

        namespace = {
            "queue": self.queue,
            "url": self.url,
            "prefetch": 200,
            "connection_name": f"mqdedup-contract:{self.queue}",
            **attributes,
        }
        return type("RabbitOrders", (ContractOrders, RabbitMQConsumer), namespace)

    def _open(self, consumer: ContractOrders) -> Transport:
        transport: Transport = consumer.create_transport()
        return transport

    def remaining(self) -> int:
        return self.admin.depth(self.queue)

    def dead_letters(self, expected: int) -> list[DeadLettered]:
        dlq = f"{self.queue}.dlq"
        wait_for(lambda: self.admin.depth(dlq) >= expected, 30, f"{expected} dead letters")
        return [
            DeadLettered(
                body=body,
                message_id=properties.message_id,
                key=None,
                headers={k: text(v) for k, v in (properties.headers or {}).items()},
            )
            for properties, body in self.admin.peek_all(dlq)
        ]

    def close(self) -> None:
        super().close()
        self.admin.delete(self.queue, f"{self.queue}.dlq")
        self.admin.close()


# -- the async consumers' transports -------------------------------------------------------------


class LoopThread:
    """An event loop running in a thread of its own, as an async application's loop.

    :meth:`call` runs a synchronous callable inside the greenlet bridge on that loop
    (``run_bridged``) and waits for its result, so sync test code (and a Worker thread)
    can drive an async consumer's transport while the loop keeps running.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kit-loop", daemon=True)
        self.thread.start()

    def call(self, fn: Any, *args: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(run_bridged(fn, *args), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()


class OnLoop:
    """A Transport whose every call runs the async consumer's transport method on the kit's loop."""

    def __init__(self, loop: LoopThread, inner: Any) -> None:
        self.loop = loop
        self.inner = inner

    def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery[Any]]:
        return self.loop.call(self.inner.fetch, max_messages, timeout)  # type: ignore[no-any-return]

    def settle(self, deliveries: Sequence[Delivery[Any]]) -> None:
        self.loop.call(self.inner.settle, deliveries)

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        self.loop.call(self.inner.give_back, deliveries)

    def dead_letter(self, delivery: Delivery[Any], record: DeadLetter) -> None:
        self.loop.call(self.inner.dead_letter, delivery, record)

    def keepalive(self) -> None:
        self.loop.call(self.inner.keepalive)

    def close(self) -> None:
        self.loop.call(self.inner.close)


class AsyncKafkaKit(KafkaKit):
    name = "async-kafka"

    def __init__(self, helper: KafkaHelper) -> None:
        super().__init__(helper)
        self.loop = LoopThread()

    def consumer_class(self, **attributes: Any) -> type[ContractOrders]:
        from mqdedup.kafka import AsyncKafkaConsumer

        namespace = {
            "topics": [self.topic],
            "group_id": self.group,
            "bootstrap_servers": self.helper.bootstrap,
            "kafka_config": KAFKA_CONFIG,
            "commit_interval": 0.0,
            **attributes,
        }
        return type("AsyncKafkaOrders", (AsyncContractOrders, AsyncKafkaConsumer), namespace)

    def _open(self, consumer: ContractOrders) -> Transport:
        return OnLoop(self.loop, self.loop.call(consumer.create_transport))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.loop.close()


class AsyncRabbitMQKit(RabbitMQKit):
    name = "async-rabbitmq"

    def __init__(self, url: str) -> None:
        self.loop = LoopThread()
        super().__init__(url)

    def consumer_class(self, **attributes: Any) -> type[ContractOrders]:
        from mqdedup.rabbitmq import AsyncRabbitMQConsumer

        namespace = {
            "queue": self.queue,
            "url": self.url,
            "prefetch": 200,
            "connection_name": f"mqdedup-contract:{self.queue}",
            **attributes,
        }
        return type("AsyncRabbitOrders", (AsyncContractOrders, AsyncRabbitMQConsumer), namespace)

    def _open(self, consumer: ContractOrders) -> Transport:
        return OnLoop(self.loop, self.loop.call(consumer.create_transport))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.loop.close()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("kafka", marks=pytest.mark.integration),
        pytest.param("rabbitmq", marks=pytest.mark.integration),
        pytest.param("async-kafka", marks=pytest.mark.integration),
        pytest.param("async-rabbitmq", marks=pytest.mark.integration),
    ]
)
def transport_kit(request: pytest.FixtureRequest) -> Iterator[TransportKit]:
    """Each transport in turn: in-memory, Kafka, RabbitMQ, and Kafka and RabbitMQ driven
    by async consumers (fresh source per test)."""
    kit: TransportKit
    if request.param == "memory":
        kit = MemoryKit()
    elif request.param == "kafka":
        kit = KafkaKit(request.getfixturevalue("kafka_helper"))
    elif request.param == "async-kafka":
        kit = AsyncKafkaKit(request.getfixturevalue("kafka_helper"))
    elif request.param == "async-rabbitmq":
        kit = AsyncRabbitMQKit(request.getfixturevalue("rabbitmq_url"))
    else:
        kit = RabbitMQKit(request.getfixturevalue("rabbitmq_url"))
    try:
        yield kit
    finally:
        kit.close()


@dataclass(frozen=True)
class OrdersDatabase:
    """The database a kit's Worker test writes to, and its ``orders`` table."""

    db: TestDatabase
    orders: Table


@pytest.fixture
def orders_db(
    transport_kit: TransportKit, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[OrdersDatabase]:
    """SQLite for the in-memory kit, the shared PostgreSQL for real brokers."""
    prefix = table_prefix()
    orders = orders_table(prefix)
    if transport_kit.name == "memory":
        url, service = f"sqlite:///{tmp_path / 'contract.db'}", "SQLite"
    else:
        url, service = request.getfixturevalue("pg_url"), "PostgreSQL"
    with prefixed_database(url, service, orders.metadata, prefix=prefix) as db:
        yield OrdersDatabase(db, orders)


# -- the Publisher suite's kits ----------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """A record as a consumer of the destination reads it."""

    message_id: str | None
    key: bytes | None
    headers: Mapping[str, str]
    payload: bytes


class PublisherKit(abc.ABC):
    """One broker, as the Publisher suite sees it: a publisher, a fresh destination."""

    name: ClassVar[str]
    broker: ClassVar[str]
    #: Where order is kept: per ``key`` (Kafka partitions) or the whole ``queue``.
    ordering: ClassVar[Literal["key", "queue"]]
    keeps_key: ClassVar[bool]

    def __init__(self) -> None:
        self._publishers: list[Publisher] = []
        self._ids = iter(range(1, 1_000_000))

    @abc.abstractmethod
    def _publisher(self) -> Publisher:
        """A publisher connected to the shared broker."""

    @abc.abstractmethod
    def _unreachable(self) -> Publisher:
        """A publisher whose broker is down (nothing listens at its address)."""

    @abc.abstractmethod
    def record(self, message_id: str, payload: bytes, key: bytes | None) -> OutboxRecord:
        """An outbox record for the kit's destination."""

    @abc.abstractmethod
    def refused_record(self, message_id: str) -> OutboxRecord:
        """A record this broker refuses for good (too large, unroutable)."""

    @abc.abstractmethod
    def on_broker(self) -> int:
        """How many records the destination holds now (no waiting)."""

    @abc.abstractmethod
    def read(self, expected: int) -> list[Received]:
        """The destination's records in order (per partition for Kafka)."""

    def publisher(self, *, reachable: bool = True) -> Publisher:
        made = self._publisher() if reachable else self._unreachable()
        self._publishers.append(made)
        return made

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        for publisher in self._publishers:
            publisher.close()


def outbox_record(
    number: int,
    broker: str,
    destination: str,
    routing_key: str | None,
    message_id: str,
    payload: bytes,
    key: bytes | None,
) -> OutboxRecord:
    """An outbox row as the relay hands it to a publisher (``message-id`` header set)."""
    return OutboxRecord(
        id=number,
        message_id=message_id,
        broker=broker,
        destination=destination,
        routing_key=routing_key,
        key=key,
        headers={"message-id": message_id, "x-test": f"h-{message_id}"},
        properties={"message_id": message_id} if broker == "rabbitmq" else None,
        payload=payload,
        attempts=0,
        created_at=datetime.now(UTC),
    )


class MemoryPublisherKit(PublisherKit):
    name = "memory"
    broker = "kafka"
    ordering = "queue"
    keeps_key = True
    limit = 1000

    def __init__(self) -> None:
        super().__init__()
        self.memory = InMemoryBroker()
        self.topic = "contract-out"

    def _refuse(self, record: OutboxRecord) -> str | None:
        return "record too large" if len(record.payload) > self.limit else None

    def _publisher(self) -> Publisher:
        return MemoryPublisher(self.memory, reject=self._refuse)

    def _unreachable(self) -> Publisher:
        publisher = MemoryPublisher(self.memory)
        publisher.available = False
        return publisher

    def record(self, message_id: str, payload: bytes, key: bytes | None) -> OutboxRecord:
        return outbox_record(self.next_id(), "kafka", self.topic, None, message_id, payload, key)

    def refused_record(self, message_id: str) -> OutboxRecord:
        return self.record(message_id, b"x" * (self.limit + 1), None)

    def on_broker(self) -> int:
        return self.memory.pending(self.topic)

    def read(self, expected: int) -> list[Received]:
        transport = self.memory.transport(self.topic)
        messages = [d.message for d in transport.fetch(max(expected, 1) * 2, 0.0)]
        return [
            Received(
                m.header("message-id"), m.key, {k: text(v) for k, v in m.headers.items()}, m.body
            )
            for m in messages
        ]


class KafkaPublisherKit(PublisherKit):
    name = "kafka"
    broker = "kafka"
    ordering = "key"
    keeps_key = True
    #: The destination topic's ``max.message.bytes``: larger records are refused.
    limit = 4096

    def __init__(self, helper: KafkaHelper) -> None:
        super().__init__()
        self.helper = helper
        self.topic = helper.create_topic(
            partitions=2, kind="contract-out", config={"max.message.bytes": str(self.limit)}
        )

    def _publisher(self) -> Publisher:
        from mqdedup.kafka import KafkaPublisher

        return KafkaPublisher(self.helper.bootstrap, flush_timeout=15.0)

    def _unreachable(self) -> Publisher:
        from mqdedup.kafka import KafkaPublisher

        return KafkaPublisher(
            f"127.0.0.1:{free_port()}", flush_timeout=2.0, metadata_timeout=1.0, connect_timeout=1.0
        )

    def record(self, message_id: str, payload: bytes, key: bytes | None) -> OutboxRecord:
        return outbox_record(self.next_id(), "kafka", self.topic, None, message_id, payload, key)

    def refused_record(self, message_id: str) -> OutboxRecord:
        return self.record(message_id, b"x" * (self.limit * 4), None)

    def on_broker(self) -> int:
        return sum(self.helper.end_offsets(self.topic).values())

    def read(self, expected: int) -> list[Received]:
        return [
            Received(
                text(dict(r.headers).get("message-id", b"")) or None,
                r.key,
                {name: text(value) for name, value in r.headers},
                r.value,
            )
            for r in self.helper.read_all(self.topic, expected, timeout=30)
        ]


class RabbitMQPublisherKit(PublisherKit):
    name = "rabbitmq"
    broker = "rabbitmq"
    ordering = "queue"
    keeps_key = False

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.admin = RabbitAdmin(url)
        self.queue = self.admin.queue("contract-out")

    def _publisher(self) -> Publisher:
        from mqdedup.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher(self.url, confirm_timeout=15.0)

    def _unreachable(self) -> Publisher:
        from mqdedup.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher(
            f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F",
            confirm_timeout=2.0,
            connect_timeout=1.0,
        )

    def record(self, message_id: str, payload: bytes, key: bytes | None) -> OutboxRecord:
        return outbox_record(self.next_id(), "rabbitmq", "", self.queue, message_id, payload, key)

    def refused_record(self, message_id: str) -> OutboxRecord:
        """Unroutable: the default exchange has no queue of that name (``mandatory``)."""
        return outbox_record(
            self.next_id(), "rabbitmq", "", f"{self.queue}-nowhere", message_id, b"{}", None
        )

    def on_broker(self) -> int:
        return self.admin.depth(self.queue)

    def read(self, expected: int) -> list[Received]:
        return [
            Received(
                properties.message_id,
                None,
                {k: text(v) for k, v in (properties.headers or {}).items()},
                body,
            )
            for properties, body in self.admin.drain(self.queue, expected, timeout=30)
        ]

    def close(self) -> None:
        super().close()
        self.admin.close()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("kafka", marks=pytest.mark.integration),
        pytest.param("rabbitmq", marks=pytest.mark.integration),
    ]
)
def publisher_kit(request: pytest.FixtureRequest) -> Iterator[PublisherKit]:
    """Each publisher in turn: in-memory, Kafka, RabbitMQ (fresh destination per test)."""
    kit: PublisherKit
    if request.param == "memory":
        kit = MemoryPublisherKit()
    elif request.param == "kafka":
        kit = KafkaPublisherKit(request.getfixturevalue("kafka_helper"))
    else:
        kit = RabbitMQPublisherKit(request.getfixturevalue("rabbitmq_url"))
    try:
        yield kit
    finally:
        kit.close()
