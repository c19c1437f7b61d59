"""Prove your own consumer is effectively-once: a pytest plugin and a harness.

Installed with mqdedup, the plugin gives every test suite these fixtures:

* ``mqdedup_engine``: a database with the framework's tables (a temporary SQLite file,
  or ``MQDEDUP_TEST_DATABASE_URL`` when set);
* ``mqdedup_harness``: ``mqdedup_harness(MyConsumer)`` returns a
  :class:`ConsumerHarness` that runs your consumer on the in-memory broker and injects
  the faults brokers really produce.

Example::

    def test_orders_are_effectively_once(mqdedup_harness, mqdedup_engine):
        harness = mqdedup_harness(OrderConsumer)
        for n in range(100):
            harness.publish({"id": n}, message_id=f"order-{n}")
        harness.deliver_each_twice()
        harness.run_crashing_after_commit(times=3)
        harness.run_crashing_mid_batch(after_messages=7)
        harness.run()
        assert_effectively_once(count_orders_by_message_id(mqdedup_engine), harness.ids)

Async consumers (``AsyncConsumer``) use the same harness and fixtures: each run starts
an event loop with an ``AsyncEngine`` on the test database (aiosqlite / psycopg 3
async), as ``mqdedup worker`` does; call the harness from plain (sync) tests.

The same consumer class runs on real brokers, in real worker processes that are killed
with ``kill -9``, through ``mqdedup_kafka_harness`` / ``mqdedup_rabbitmq_harness``
(:mod:`mqdedup.testing.brokers`); see docs/testing.md.

Effects downstream (the messages your handler sends on) are checked with
:func:`downstream_effects`: a deduplicating next consumer applies each distinct message
id once, so the effect of one incoming message is the number of *distinct* ids sent
for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.bridge import call_hook
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import Context
from mqdedup.consumers.memory import InMemoryBroker, MemoryTransport
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.engine import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import SimulatedCrash
from mqdedup.message import Message
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.outbox.memory import MemoryPublisher
from mqdedup.testing.brokers import KafkaHarness, RabbitMQHarness
from mqdedup.testing.effects import (
    DownstreamMessage,
    EffectivelyOnceError,
    assert_effectively_once,
    downstream_effects,
)

__all__ = [
    "ConsumerHarness",
    "DownstreamMessage",
    "EffectivelyOnceError",
    "assert_effectively_once",
    "downstream_effects",
]


class ConsumerHarness:
    """Runs one consumer class over an in-memory queue, with injected faults."""

    def __init__(
        self,
        consumer_factory: Callable[[], Consumer],
        engine: Engine,
        queue: str = "harness",
        seed: int = 0,
        broker: InMemoryBroker | None = None,
        sessions: sessionmaker[Session] | None = None,
    ) -> None:
        self.consumer_factory = consumer_factory
        self.engine = engine
        #: What the consumer runs with (default: sessions of ``engine``); mqdedup.django
        #: passes sessions on Django's connection.
        self.database: Engine | sessionmaker[Session] = sessions or engine
        self.queue = queue
        #: The in-memory broker (pass your own to hand it to your consumer, e.g. for a
        #: handler that publishes directly).
        self.broker = broker if broker is not None else InMemoryBroker(seed=seed)
        self.ids: list[str] = []
        self.metrics = Metrics()
        self.crashes = 0

    def publish(
        self,
        payload: bytes | str | Mapping[str, Any] | Sequence[Any],
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        key: bytes | None = None,
    ) -> None:
        """Queue a message; dicts and lists are sent as JSON."""
        body = payload if isinstance(payload, bytes | str) else json.dumps(payload)
        self.broker.publish(self.queue, body, message_id=message_id, headers=headers, key=key)
        if message_id is not None:
            self.ids.append(message_id)

    def deliver_each_twice(self) -> int:
        """Queue a second copy of every queued message (as a retrying producer would)."""
        return self.broker.inject_duplicates(self.queue, 1.0)

    def inject_duplicates(self, rate: float) -> int:
        """Queue copies of about ``rate`` of the queued messages at random positions."""
        return self.broker.inject_duplicates(self.queue, rate)

    def run(self, max_batches: int | None = None) -> Metrics:
        """Process until the queue is empty (or ``max_batches``)."""
        return self._work(
            self.consumer_factory(), until_idle=max_batches is None, max_batches=max_batches
        )

    def run_crashing_after_commit(self, times: int = 1) -> None:
        """Let ``times`` batches commit and then 'die' before the broker is settled."""
        for _ in range(times):
            if not self.broker.pending(self.queue):
                return
            self._run_until_crash(_crash_after_commit(self.consumer_factory()))

    def run_crashing_mid_batch(self, after_messages: int) -> None:
        """'Die' in the middle of a batch, after ``after_messages`` handler calls."""
        if self.broker.pending(self.queue):
            self._run_until_crash(_crash_mid_batch(self.consumer_factory(), after_messages))

    def _run_until_crash(self, consumer: Consumer) -> None:
        try:
            self._work(consumer, until_idle=True)
        except SimulatedCrash:
            self.crashes += 1  # the transport was closed: unsettled deliveries are back

    def _work(self, consumer: Consumer, **run: Any) -> Metrics:
        """One worker over the harness queue (``run``: ``Worker.run``'s arguments).

        An async consumer runs as in production: on an event loop of its own, with an
        ``AsyncEngine`` on the harness database's URL (aiosqlite, psycopg 3 async).
        """
        transport = self.broker.transport(self.queue)
        if not consumer.asynchronous:
            return Worker(consumer, transport, self.database, metrics=self.metrics).run(**run)
        return asyncio.run(self._work_async(consumer, transport, run))

    async def _work_async(
        self, consumer: Consumer, transport: MemoryTransport, run: dict[str, Any]
    ) -> Metrics:
        engine = create_async_engine(self.engine)
        try:
            worker = Worker(consumer, transport, engine, metrics=self.metrics)
            return await worker.run_async(**run)
        finally:
            await engine.dispose()

    def run_relay(self, timeout: float = 60.0) -> int:
        """Publish the committed outbox rows with the real relay into the in-memory
        broker (a queue per topic / routing key); returns the rows published."""

        publisher = MemoryPublisher(self.broker)
        relay = Relay(
            self.engine,
            {"kafka": publisher, "rabbitmq": publisher},
            prefix=self.consumer_factory().table_prefix,
            config=RelayConfig(poll_interval=0.05, listen=False),
        )
        try:
            relay.drain(timeout)
        finally:
            relay.close()
        return len(publisher.published)

    def downstream(self, queue: str) -> list[DownstreamMessage]:
        """Take every message waiting in in-memory ``queue`` (e.g. your output topic)."""
        transport = self.broker.transport(queue)
        taken: list[DownstreamMessage] = []
        while deliveries := transport.fetch(1000, 0.0):
            taken.extend(DownstreamMessage.from_message(d.message) for d in deliveries)
            transport.settle(deliveries)
        transport.close()
        return taken

    @property
    def dead_letters(self) -> list[Any]:
        """Dead-lettered messages with their reasons."""
        return list(self.broker.dead_letters.get(self.queue, []))


def _crash_after_commit(consumer: Consumer) -> Consumer:
    original = consumer.after_commit

    def after_commit(messages: Sequence[Message]) -> None:
        call_hook(original, messages)  # an async consumer's hook is awaited
        raise SimulatedCrash("crash between commit and settle")

    consumer.after_commit = after_commit  # type: ignore[method-assign]
    return consumer


def _crash_mid_batch(consumer: Consumer, after_messages: int) -> Consumer:
    calls = {"n": 0}
    handle, handle_batch = consumer.handle, consumer.handle_batch

    def guard(messages: int) -> None:
        calls["n"] += messages
        if calls["n"] > after_messages:
            raise SimulatedCrash("crash in the middle of a batch")

    def crashing_handle(message: Message, ctx: Context) -> Any:
        guard(1)
        return handle(message, ctx)

    def crashing_batch(messages: Sequence[Message], ctx: Any) -> Any:
        guard(len(messages))
        return handle_batch(messages, ctx)

    consumer.handle = crashing_handle  # type: ignore[method-assign]
    if consumer.has_batch_handler:
        consumer.handle_batch = crashing_batch  # type: ignore[method-assign]
    return consumer


# -- pytest fixtures -------------------------------------------------------------------


TESTING_DATABASE_ENV = "MQDEDUP_TESTING_DATABASE_URL"


@pytest.fixture
def mqdedup_engine() -> Iterator[Engine]:
    """A database with mqdedup's tables, empty at the start of each test.

    A temporary SQLite file, or the database named by ``MQDEDUP_TESTING_DATABASE_URL``
    (e.g. your PostgreSQL), whose framework tables are emptied before each test.
    """
    url = os.environ.get(TESTING_DATABASE_ENV)
    with tempfile.TemporaryDirectory(prefix="mqdedup-test-") as folder:
        engine = create_engine(url or f"sqlite:///{Path(folder) / 'test.db'}")
        init_schema(engine)
        if url:
            with engine.begin() as connection:
                for table in reversed(schema().metadata.sorted_tables):
                    connection.execute(table.delete())
        try:
            yield engine
        finally:
            engine.dispose()


@pytest.fixture
def mqdedup_harness(mqdedup_engine: Engine) -> Callable[..., ConsumerHarness]:
    """``mqdedup_harness(ConsumerClass or factory)`` → a :class:`ConsumerHarness`."""

    def make(consumer: Callable[[], Consumer], **options: Any) -> ConsumerHarness:
        return ConsumerHarness(consumer, mqdedup_engine, **options)

    return make


@pytest.fixture
def mqdedup_database_url(tmp_path: Path) -> str:
    """The database of the real-broker harnesses, shared with their worker processes.

    ``MQDEDUP_TESTING_DATABASE_URL`` (PostgreSQL recommended), else a temporary SQLite
    file. Each harness uses its own table prefix there, so tests may run in parallel.
    """
    return os.environ.get(TESTING_DATABASE_ENV) or f"sqlite:///{tmp_path / 'harness.db'}"


def _require(service: str, reason: str) -> None:
    """Skip locally; fail when ``CI`` is set (a missing service must not pass there)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{service} is required in CI but unavailable: {reason}")
    pytest.skip(f"{service} unavailable: {reason}")


@pytest.fixture
def mqdedup_kafka_harness(
    mqdedup_database_url: str, tmp_path: Path
) -> Iterator[Callable[..., KafkaHarness]]:
    """``mqdedup_kafka_harness(MyKafkaConsumer)`` → a
    :class:`~mqdedup.testing.brokers.KafkaHarness`.

    The broker is ``bootstrap=`` or ``$MQDEDUP_KAFKA_BOOTSTRAP`` (skipped when unset,
    failed under ``CI``). Other keyword arguments: ``partitions``, ``attributes``
    (class attributes for the workers, e.g. ``{"batch_size": 10}``), ``database_url``,
    ``timeout``. Everything the harness created is removed at the end of the test.
    """
    made: list[KafkaHarness] = []

    def make(
        consumer_class: type[Consumer], *, bootstrap: str | None = None, **options: Any
    ) -> KafkaHarness:
        address = bootstrap or os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
        if not address:
            _require("Kafka", "MQDEDUP_KAFKA_BOOTSTRAP is not set")
        assert address is not None
        options.setdefault("database_url", mqdedup_database_url)
        folder = tmp_path / f"kafka-harness-{len(made) + 1}"
        folder.mkdir()
        harness = KafkaHarness(consumer_class, folder=folder, bootstrap=address, **options)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


@pytest.fixture
def mqdedup_rabbitmq_harness(
    mqdedup_database_url: str, tmp_path: Path
) -> Iterator[Callable[..., RabbitMQHarness]]:
    """``mqdedup_rabbitmq_harness(MyRabbitMQConsumer)`` → a
    :class:`~mqdedup.testing.brokers.RabbitMQHarness`.

    The broker is ``url=`` or ``$MQDEDUP_RABBITMQ_URL`` (skipped when unset, failed
    under ``CI``). Other keyword arguments: ``attributes``, ``database_url``, ``timeout``.
    """
    made: list[RabbitMQHarness] = []

    def make(
        consumer_class: type[Consumer], *, url: str | None = None, **options: Any
    ) -> RabbitMQHarness:
        address = url or os.environ.get("MQDEDUP_RABBITMQ_URL")
        if not address:
            _require("RabbitMQ", "MQDEDUP_RABBITMQ_URL is not set")
        assert address is not None
        options.setdefault("database_url", mqdedup_database_url)
        folder = tmp_path / f"rabbitmq-harness-{len(made) + 1}"
        folder.mkdir()
        harness = RabbitMQHarness(consumer_class, folder=folder, url=address, **options)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
