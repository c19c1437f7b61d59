"""The pika internals of the RabbitMQ adapter, and what happens without them
(docs/architecture.md, "Third-party internals in the adapters"), on real brokers.

* its own ``basic.publish`` frames (``_adapter_emit_data``, ``_body_max_length``): the
  messages on the broker are the same as through pika's ``basic_publish``, which every
  message takes when pika lacks them;
* closing the publisher during a memory alarm: pika's ``_terminate_stream`` is no longer
  used (issue 41: it only made the dropped connection leave the broker 0.4 s after the
  alarm instead of after the broker's heartbeat timeout, 181 s): the close returns all
  the same and the publisher publishes again on a fresh connection;
* the reason the broker closed the consuming channel: pika keeps it only in
  ``_closing_reason``, which the adapter no longer reads (issue 41); the delivery fast
  path (``io_frames``) reads it from the ``channel.close`` frame, and without the fast
  path pika's own WARNING names it.

The consumer's decoding of deliveries (``io_frames``) is in ``test_rabbitmq_decoding.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pika
import pika.connection
import pytest

import mqdedup.rabbitmq.io_thread
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.rabbitmq import RabbitMQPublisher, Topology
from mqdedup.rabbitmq.publish_frames import PublishFrames
from mqdedup.rabbitmq.transport import RabbitMQTransport
from tests.services import PrivateRabbitMQ, RabbitAdmin, wait_for

pytestmark = [pytest.mark.integration]


class _Opaque:
    """A pika connection as another pika version may have it: none of its internals."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection


def _records(queue: str, user: str) -> list[OutboxRecord]:
    now = datetime.now(UTC)
    properties: list[dict[str, Any] | None] = [
        None,
        {"message_id": "m-1", "content_type": "application/json", "priority": 3},
        {"message_id": "m-2", "user_id": user, "timestamp": 1_700_000_000, "app_id": "shop"},
        {"message_id": "m-3", "correlation_id": "c", "reply_to": "r", "expiration": "60000"},
        {"message_id": "m-4", "type": "order.created", "content_encoding": "identity"},
    ]
    bodies = [b'{"n": 0}', b"", bytes(range(256)) * 1200, "é ünïcode".encode(), b"\xff\xfe"]
    return [
        OutboxRecord(
            id=n,
            message_id=f"m-{n}",
            broker="rabbitmq",
            destination="",
            routing_key=queue,
            key=None,
            headers={"message-id": f"m-{n}", "n": n, "flag": n % 2 == 0, "text": "é"},
            properties=props,
            payload=body,
            attempts=0,
            created_at=now,
        )
        for n, (props, body) in enumerate(zip(properties, bodies, strict=True))
    ]


@pytest.mark.parametrize("internals", ["pika's", "missing (basic_publish)"])
def test_the_relay_puts_the_same_messages_on_the_broker_with_or_without_its_own_frames(
    rabbitmq_url: str, rabbit: RabbitAdmin, internals: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = rabbit.queue("publish-frames")
    records = _records(queue, pika.URLParameters(rabbitmq_url).credentials.username)
    real_open = PublishFrames.open.__func__  # type: ignore[attr-defined]
    writers: list[PublishFrames | None] = []

    def open_frames(cls: type[PublishFrames], connection: Any, channel: Any) -> Any:
        if internals != "pika's":
            connection = _Opaque(connection)
        writers.append(real_open(cls, connection, channel))
        return writers[-1]

    monkeypatch.setattr(PublishFrames, "open", classmethod(open_frames))
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        results = publisher.publish_batch(records)
    finally:
        publisher.close()
    assert [r.ok for r in results] == [True] * len(records)
    assert writers and all((w is not None) is (internals == "pika's") for w in writers)

    got = rabbit.drain(queue, len(records))
    assert [body for _, body in got] == [r.payload for r in records]
    for (properties, _), record in zip(got, records, strict=True):
        expected = pika.BasicProperties(
            delivery_mode=2, headers=dict(record.headers), **(record.properties or {})
        )
        assert vars(properties) == vars(expected)


@pytest.mark.slow
def test_closing_the_relay_publisher_during_a_memory_alarm(private_rabbit: PrivateRabbitMQ) -> None:
    """A blocked connection cannot finish its close handshake: the close returns all the
    same (the connection is dropped; the broker closes it after its heartbeat timeout),
    and the publisher publishes again on a fresh connection once the alarm is over."""
    node = private_rabbit
    name = f"mqdedup-relay-{uuid.uuid4().hex[:8]}"
    queue = f"alarm-close-{uuid.uuid4().hex[:8]}"
    admin = RabbitAdmin(node.url)
    admin.channel().queue_declare(queue, durable=True)
    records = _records(queue, "guest")
    publisher = RabbitMQPublisher(node.url, confirm_timeout=1.0, connect_timeout=2.0)
    publisher.parameters.client_properties = {"connection_name": name}
    assert [r.ok for r in publisher.publish_batch(records[:1])] == [True]
    wait_for(lambda: len(node.connections(name)) == 1, 10, "the relay's connection")

    node.memory_alarm(True)
    try:
        # The broker blocks the connection at its next publish (that one may still pass).
        for _ in range(5):
            [result] = publisher.publish_batch(records[1:2])
            if not result.ok:
                break
        assert not result.ok  # unavailable while the broker blocks publishers
        started = time.monotonic()
        publisher.close()
        assert time.monotonic() - started < 5.0, "the close never waits for the alarm"
    finally:
        node.memory_alarm(False)
    assert [r.ok for r in publisher.publish_batch(records[2:3])] == [True]
    publisher.close()
    arrived = {p.headers["message-id"] for p, _ in admin.drain(queue, 2)}
    assert arrived >= {"m-0", "m-2"}  # m-1 too, if the broker took it before the close
    admin.close()


@pytest.mark.parametrize("internals", ["pika's", "missing (pika's own path)"])
def test_the_log_names_why_the_broker_closed_the_consuming_channel(
    rabbitmq_url: str,
    rabbit: RabbitAdmin,
    caplog: pytest.LogCaptureFixture,
    internals: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ack of a tag the broker never sent: the broker closes the consuming channel
    (406) and the consumer reattaches. The consumer's line names the broker's reason,
    read by the delivery fast path; without it, the line points at pika's own WARNING,
    which names it."""
    fast = internals == "pika's"
    if not fast:
        monkeypatch.setattr(mqdedup.rabbitmq.io_thread, "install_fast_path", lambda *_: None)
    queue = rabbit.queue("close-reason")
    transport = RabbitMQTransport(
        Topology(queue), rabbitmq_url, connection_name=f"close-reason-{queue}", prefetch=10
    ).start()
    try:
        generation = transport.live_generation
        assert generation is not None
        # pika's own WARNING is part of what is checked: whatever level an earlier
        # configure_logging() (the CLI's, in-process) left on the "pika" logger.
        caplog.set_level(logging.WARNING, logger="pika")
        with caplog.at_level(logging.WARNING):
            transport._submit(
                lambda: transport._channel.basic_ack(delivery_tag=987_654),
                generation,
                "an ack the broker refuses",
                detached=True,
            )
            wait_for(lambda: transport.generation > generation, 30, "the consumer to reattach")
    finally:
        transport.close()
    [detached] = [
        r for r in caplog.records if r.getMessage().startswith("RabbitMQ consumer detached")
    ]
    [pikas] = [
        r for r in caplog.records if r.getMessage().startswith("Received remote Channel.Close")
    ]
    assert "406" in pikas.getMessage() and "PRECONDITION_FAILED" in pikas.getMessage()
    if fast:
        assert "406" in detached.error and "PRECONDITION_FAILED" in detached.error
    else:
        assert "Received remote Channel.Close" in detached.error, detached.error
    rabbit.delete(f"{queue}.dlq")
