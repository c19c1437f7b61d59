"""Async consumers on the one transport of their broker (issue 41), driven from the loop.

* a fetch waiting for deliveries, on Kafka and on RabbitMQ, leaves the event loop free:
  a ticker task on the same loop keeps ticking while the idle consumer waits;
* ``task.cancel()`` while the fetch waits ends ``run_async`` within the 2 s bound with
  ``CancelledError`` (a graceful stop: nothing in flight);
* outside the bridge, :class:`BridgedTransport` is the transport itself (plain calls);
* a start abandoned by a second cancel closes the transport it started;
* ``aiokafka_config`` (the removed aiokafka stack's settings) is a one-line
  configuration error naming what to use instead;
* the adapters load neither aiokafka nor aio-pika.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from mqdedup import AsyncContext, Message
from mqdedup.consumers.bridged_transport import BridgedTransport
from mqdedup.consumers.memory import InMemoryBroker
from mqdedup.errors import ConfigurationError
from tests.services import KafkaHelper, RabbitAdmin, wait_for_on_loop

#: The Transport contract's bound on a stop, in any state.
STOP_BOUND = 2.0


class Idle:
    """Handles nothing: the source stays empty, so the worker sits in its fetch wait."""

    async def handle(self, message: Message, ctx: AsyncContext) -> None:
        return None


def idle_consumer(kind: str, request: pytest.FixtureRequest) -> Any:
    """An async consumer of a fresh, empty topic / queue; each fetch waits 1 s."""
    name = f"bridged-{uuid.uuid4().hex[:8]}"
    attributes: dict[str, Any] = {"poll_timeout": 1.0}
    if kind == "kafka":
        from mqdedup.kafka import AsyncKafkaConsumer

        helper: KafkaHelper = request.getfixturevalue("kafka_helper")
        helper.create_topic(partitions=1, name=name)
        attributes.update(topics=[name], group_id=name, bootstrap_servers=helper.bootstrap)
        base: type = AsyncKafkaConsumer
    else:
        from mqdedup.rabbitmq import AsyncRabbitMQConsumer

        url = request.getfixturevalue("rabbitmq_url")
        attributes.update(queue=name, url=url)
        base = AsyncRabbitMQConsumer

        def delete() -> None:
            admin = RabbitAdmin(url)
            try:
                admin.delete(name, f"{name}.dlq")
            finally:
                admin.close()

        request.addfinalizer(delete)
    return type("IdleOrders", (Idle, base), attributes)()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["kafka", "rabbitmq"])
def test_a_fetch_waiting_for_deliveries_leaves_the_loop_free_and_a_cancel_ends_it_within_2s(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    consumer = idle_consumer(kind, request)

    async def scenario() -> tuple[int, float, BaseException | None]:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'bridged.db'}")
        task = asyncio.ensure_future(consumer.run_async(engine))
        await asyncio.sleep(2.0)  # joined / consuming (the start runs in a thread too)
        assert not task.done(), f"the consumer ended: {task.exception()!r}"
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.ensure_future(ticker())
        await wait_for_on_loop(lambda: ticks >= 1, 30, "the ticker")
        await asyncio.sleep(3.0)  # the consumer waits for deliveries meanwhile
        assert not task.done(), f"the consumer ended: {task.exception()!r}"
        ticks_during_wait = ticks
        cancelled = time.monotonic()
        task.cancel()
        outcome: BaseException | None = None
        try:
            await asyncio.wait_for(task, 60)
        except BaseException as error:
            outcome = error
        took = time.monotonic() - cancelled
        ticking.cancel()
        await engine.dispose()
        return ticks_during_wait, took, outcome

    ticks, took, outcome = asyncio.run(scenario())
    print(f"{kind}: {ticks} ticks of 10 ms in 3 s of fetch waits; cancel took {took:.2f} s")
    # A loop blocked by the fetch ticks about once per wait (1 s); a free one ~100 times a
    # second (fewer on a loaded machine: the bound leaves room).
    assert ticks >= 60, f"{kind}: the loop was blocked while the fetch waited ({ticks} ticks)"
    assert isinstance(outcome, asyncio.CancelledError), f"ended with {outcome!r}"
    assert took < STOP_BOUND, f"{kind}: the cancel took {took:.1f} s"


def test_outside_the_bridge_the_calls_go_straight_to_the_transport() -> None:
    broker = InMemoryBroker()
    broker.publish("orders", b"a", message_id="a")
    broker.publish("orders", b"b", message_id="b")
    transport = BridgedTransport(broker.transport("orders"))
    try:
        deliveries = transport.fetch(10, 0.1)
        assert [d.message.body for d in deliveries] == [b"a", b"b"]
        transport.settle(deliveries[:1])
        transport.give_back(deliveries[1:])
        assert [d.message.body for d in transport.fetch(10, 0.1)] == [b"b"]
    finally:
        transport.close()
    assert broker.settled_count["orders"] == 1


def test_a_start_whose_await_is_cancelled_closes_what_it_started() -> None:
    """A second cancel abandons the await of a start still connecting; when that start
    finishes in its thread, the transport it started is closed, not leaked."""
    import threading

    from mqdedup.bridge import run_bridged

    release, closed = threading.Event(), threading.Event()
    broker = InMemoryBroker()

    class Slow:
        def __init__(self) -> None:
            self.inner = broker.transport("orders")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def close(self) -> None:
            closed.set()
            self.inner.close()

    def start() -> Any:
        release.wait(10)
        return Slow()

    async def scenario() -> None:
        task = asyncio.ensure_future(run_bridged(BridgedTransport.start, start))
        await asyncio.sleep(0.2)  # in the start's await
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    release.set()
    assert closed.wait(10), "the transport started after the cancel was never closed"


def test_aiokafka_config_is_refused_naming_its_replacement() -> None:
    from mqdedup.kafka import AsyncKafkaConsumer

    class Orders(AsyncKafkaConsumer):
        topics = ("orders",)
        group_id = "orders"
        bootstrap_servers = "127.0.0.1:1"
        aiokafka_config = {"ssl_context": None}  # noqa: RUF012

        async def handle(self, message: Message, ctx: AsyncContext) -> None:
            return None

    with pytest.raises(ConfigurationError, match="aiokafka_config") as refused:
        Orders().validate()
    assert "kafka_config under their kafka-python names" in str(refused.value)


def test_the_adapters_load_neither_aiokafka_nor_aio_pika() -> None:
    probe = (
        "import sys; import mqdedup.kafka, mqdedup.rabbitmq; "
        "from mqdedup.kafka import AsyncKafkaConsumer; "
        "from mqdedup.rabbitmq import AsyncRabbitMQConsumer; "
        "loaded = [m for m in ('aiokafka', 'aio_pika', 'aiormq') if m in sys.modules]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
