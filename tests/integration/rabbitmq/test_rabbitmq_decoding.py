"""The consumer's own decoding of deliveries (``mqdedup/rabbitmq/io_frames.py``) on the
real broker: the messages a handler gets are exactly what pika's own decoding makes of
the same broker frames, for every kind of message, in the broker's order; and the same
messages when pika lacks the internals the fast path uses (pika's own path then)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pika
import pytest

import mqdedup.rabbitmq.io_thread
from mqdedup.rabbitmq import Binding, RabbitMQConsumer
from mqdedup.rabbitmq.codec import to_message
from tests.contract.conftest import fetch
from tests.services import RabbitAdmin, unique_name


def _messages(user: str) -> list[tuple[bytes, pika.BasicProperties]]:
    every_property = pika.BasicProperties(
        content_type="application/octet-stream",
        content_encoding="identity",
        headers={
            "text": "é",
            "int": 7,
            "decimal": Decimal("1.50"),
            "flag": True,
            "when": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
            "nested": {"a": [1, "two"]},
            "raw": b"\x00\x01",
            "none": None,
            "x-delivery-count": 3,
        },
        delivery_mode=2,
        priority=5,
        correlation_id="corr-4",
        reply_to="replies",
        expiration="600000",
        message_id="m-4",
        timestamp=1_700_000_000,
        type="order.created",
        user_id=user,
        app_id="shop",
    )
    large = bytes(range(256)) * 1600  # 409,600 bytes: several body frames
    return [
        (b'{"n": 1}', pika.BasicProperties(message_id="m-1", delivery_mode=2)),
        (b"", pika.BasicProperties(message_id="m-2", delivery_mode=2)),
        (large, pika.BasicProperties(message_id="m-3", delivery_mode=2)),
        (b"\xff\xfe not UTF-8", every_property),
        (b"{}", pika.BasicProperties(message_id="é-5 ünïcode", delivery_mode=2)),
    ]


class _Probe(RabbitMQConsumer):
    def handle(self, message: Any, ctx: Any) -> None:  # pragma: no cover - never run
        raise AssertionError("not run")


class _WithoutInternals:
    """A pika ``BlockingConnection`` as another pika version may have it: without the
    ``_impl`` internals the delivery fast path relies on."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection


@pytest.mark.parametrize("internals", ["pika's", "missing (pika's own path)"])
def test_messages_decoded_by_the_consumer_equal_pikas_decoding_in_broker_order(
    rabbitmq_url: str, rabbit: RabbitAdmin, internals: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = internals == "pika's"
    if not fast:
        install = mqdedup.rabbitmq.io_thread.install_fast_path
        monkeypatch.setattr(
            mqdedup.rabbitmq.io_thread,
            "install_fast_path",
            lambda connection, *args: install(_WithoutInternals(connection), *args),
        )
    exchange = unique_name("decoding")
    queue = unique_name("decoding")
    consumer = type(
        "Decoding",
        (_Probe,),
        {"queue": queue, "url": rabbitmq_url, "bindings": (Binding(exchange, "", "fanout"),)},
    )()
    try:
        _run(consumer, rabbitmq_url, rabbit, exchange, queue, fast=fast)
    finally:
        channel = rabbit.channel()
        channel.queue_delete(queue)
        channel.queue_delete(f"{queue}.dlq")
        channel.exchange_delete(exchange)


def _run(
    consumer: RabbitMQConsumer,
    url: str,
    rabbit: RabbitAdmin,
    exchange: str,
    queue: str,
    *,
    fast: bool,
) -> None:
    rabbit.declare(consumer)
    reference = rabbit.queue("decoding-reference")
    channel = rabbit.channel()
    channel.queue_bind(reference, exchange)
    sent = _messages(pika.URLParameters(url).credentials.username)
    for body, properties in sent:  # published before consuming: they come with ConsumeOk
        channel.basic_publish(exchange, "order.created", body, properties)

    transport = consumer.create_transport()
    try:
        # The consumer decodes its deliveries itself, unless pika lacks the internals.
        assert (transport._fast_path is not None) is fast
        deliveries = fetch(transport, len(sent))
        expected = []
        for _ in sent:
            method, properties, body = channel.basic_get(reference, auto_ack=True)
            expected.append(to_message(queue, method, properties, body))

        got = [delivery.message for delivery in deliveries]
        assert [m.properties.get("message_id") for m in got] == [p.message_id for _, p in sent]
        assert got == expected  # body, headers, properties, timestamp, attempt, ...
        assert [dict(m.properties) for m in got] == [dict(m.properties) for m in expected]
        assert got[2].body == sent[2][0] and got[1].body == b""
        assert got[3].headers["when"] == "2026-01-02T03:04:05+00:00"
        assert got[3].headers["decimal"] == "1.5"
        assert got[3].attempt == 4  # x-delivery-count 3
        assert got[3].timestamp == datetime.fromtimestamp(1_700_000_000, UTC)
        assert deliveries[3].token.properties.headers["int"] == 7  # dead letters keep types

        transport.settle(deliveries)
    finally:
        transport.close()
    assert rabbit.depth(queue) == 0, "every delivery was acked"
