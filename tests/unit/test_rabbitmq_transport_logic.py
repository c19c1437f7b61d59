"""The RabbitMQ transport's bookkeeping, with a fake channel in place of the I/O thread.

The fake connection runs ``add_callback_threadsafe`` callbacks at once, so each test sees
exactly which frames the I/O thread would send.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pika
import pytest
from pika.spec import Basic

from mqdedup.consumers.transport import DeadLetter
from mqdedup.errors import BrokerUnavailableError
from mqdedup.rabbitmq import Topology
from mqdedup.rabbitmq.transport import AmqpToken, RabbitMQTransport
from mqdedup.stopping import StopToken


class FakeChannel:
    def __init__(self) -> None:
        self.is_open = True
        self.frames: list[tuple[Any, ...]] = []

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.frames.append(("ack", delivery_tag, multiple))

    def basic_nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        self.frames.append(("nack", delivery_tag, requeue))

    def basic_publish(self, **kwargs: Any) -> None:
        self.frames.append(("publish", kwargs))


class FakeConnection:
    is_open = False  # nothing to close in teardown

    def add_callback_threadsafe(self, callback: Callable[[], None]) -> None:
        callback()


def connected_transport(prefetch: int = 10, stop: StopToken | None = None) -> RabbitMQTransport:
    transport = RabbitMQTransport(
        Topology(queue="orders"),
        "amqp://guest:guest@127.0.0.1:1/%2F",
        connection_name="test",
        prefetch=prefetch,
        stop=stop,
        linger=0.0,
    )
    reconnect(transport, generation=1)
    return transport


def reconnect(transport: RabbitMQTransport, generation: int) -> FakeChannel:
    """What ``_connect`` does, minus the network."""
    channel = FakeChannel()
    transport._io_generation = generation
    transport._generation = generation
    transport._channel = channel
    transport._live_generation = generation
    transport._live_connection = FakeConnection()
    transport._connection = None
    return channel


def deliver(transport: RabbitMQTransport, *tags: int) -> None:
    for tag in tags:
        method = Basic.Deliver("ctag", tag, False, "", "orders")
        transport._on_message(None, method, pika.BasicProperties(message_id=f"m{tag}"), b"{}")


def test_batch_is_acked_with_one_multiple_ack() -> None:
    transport = connected_transport()
    deliver(transport, 1, 2, 3, 4, 5)
    batch = transport.fetch(3, timeout=0)
    assert [d.message.properties["message_id"] for d in batch] == ["m1", "m2", "m3"]
    assert all(isinstance(d.token, AmqpToken) and d.token.generation == 1 for d in batch)
    transport.settle(batch)
    assert transport._channel.frames == [("ack", 3, True)]
    rest = transport.fetch(10, timeout=0)
    transport.settle(rest)
    assert transport._channel.frames[-1] == ("ack", 5, True)
    assert transport._outstanding == set()


def test_tags_of_a_dead_channel_are_never_acked() -> None:
    transport = connected_transport()
    deliver(transport, 1, 2, 3)
    old_batch = transport.fetch(3, timeout=0)
    transport._teardown()  # the connection died while the batch was being handled
    new_channel = reconnect(transport, generation=2)
    deliver(transport, 1, 2, 3)  # the same tag numbers now name other messages
    transport.settle(old_batch)
    assert new_channel.frames == [], "a tag from generation 1 must not ack on generation 2"
    new_batch = transport.fetch(3, timeout=0)
    transport.settle(new_batch)
    assert new_channel.frames == [("ack", 3, True)]


def test_teardown_drops_the_buffer_and_disconnected_settle_is_a_no_op() -> None:
    transport = connected_transport()
    deliver(transport, 1, 2)
    batch = transport.fetch(1, timeout=0)
    channel = transport._channel
    transport._teardown()
    assert transport.fetch(10, timeout=0) == [], "buffered deliveries died with the channel"
    transport.settle(batch)
    assert channel.frames == []
    with pytest.raises(BrokerUnavailableError, match="will redeliver"):
        transport.dead_letter(batch[0], DeadLetter("r", "orders", 1))


def test_given_back_deliveries_are_nacked_with_requeue_once() -> None:
    transport = connected_transport()
    deliver(transport, 1, 2, 3, 4)
    batch = transport.fetch(3, timeout=0)
    transport.settle([batch[0], batch[2]])  # batch[1] neither settled nor dead-lettered
    assert transport._channel.frames == [("ack", 1, False), ("ack", 3, False)]
    transport.fetch(10, timeout=0)
    assert ("nack", 2, True) not in transport._channel.frames, "fetch no longer releases"
    transport.give_back([batch[1]])
    transport.give_back([batch[1], batch[0]])  # already given back / settled: ignored
    assert transport._channel.frames.count(("nack", 2, True)) == 1
    assert ("nack", 1, True) not in transport._channel.frames
    assert 2 not in transport._outstanding


def test_multiple_ack_never_covers_an_unsettled_tag() -> None:
    transport = connected_transport()
    deliver(transport, 1, 2, 3, 4, 5)
    batch = transport.fetch(5, timeout=0)
    transport.settle([d for d in batch if d.token.delivery_tag != 3])
    assert transport._channel.frames == [("ack", 2, True), ("ack", 4, False), ("ack", 5, False)]


def test_fetch_returns_at_once_when_the_prefetch_window_is_full() -> None:
    transport = connected_transport(prefetch=2)
    transport._linger = 10.0  # would wait for more if the window were not full
    deliver(transport, 1, 2)
    assert len(transport.fetch(100, timeout=5)) == 2


def test_fetch_gives_nothing_once_a_stop_is_requested() -> None:
    stop = StopToken()
    transport = connected_transport(stop=stop)
    deliver(transport, 1, 2)
    stop.request()
    assert transport.fetch(10, timeout=1) == [], "the I/O thread returns the buffer instead"


def test_cancel_on_stop_returns_the_unfetched_deliveries() -> None:
    stop = StopToken()
    transport = connected_transport(stop=stop)
    transport._consumer_tag = None  # nothing to cancel on the fake
    deliver(transport, 1, 2, 3)
    batch = transport.fetch(1, timeout=0)
    stop.request()
    transport._cancel_consuming()
    assert transport._channel.frames == [("nack", 2, True), ("nack", 3, True)]
    transport.settle(batch)  # the batch in flight is still acked
    assert transport._channel.frames[-1] == ("ack", 1, False)
