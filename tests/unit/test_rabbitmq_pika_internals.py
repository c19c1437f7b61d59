"""The RabbitMQ adapter's pika internals: each has a public-API fallback, used when a pika
version lacks it (docs/architecture.md, "Third-party internals in the adapters").

The fast paths' own fallbacks (``io_frames.install`` and ``PublishFrames.open`` give
None) are tested in ``test_rabbitmq_io_frames.py`` and ``test_rabbitmq_publish_frames.py``,
and on the broker in ``tests/integration/rabbitmq``.
"""

from __future__ import annotations

import logging
from typing import Any

import pika.exceptions
import pytest

from mqdedup.rabbitmq.io_thread import channel_close_reason
from mqdedup.rabbitmq.publisher import RabbitMQPublisher


class _Channel:
    """A closed ``BlockingChannel``; ``reason`` given: pika keeps it (its internal)."""

    is_closed = True

    def __init__(self, **reason: Any) -> None:
        if "reason" in reason:
            self._closing_reason = reason["reason"]


def test_the_reason_the_broker_closed_the_channel_is_named_when_pika_keeps_it() -> None:
    closed = pika.exceptions.ChannelClosedByBroker(406, "PRECONDITION_FAILED - unknown tag")
    assert channel_close_reason(_Channel(reason=closed)) == (
        "ChannelClosedByBroker(406, 'PRECONDITION_FAILED - unknown tag')"
    )


def test_without_pikas_closing_reason_the_channel_is_still_known_closed() -> None:
    assert channel_close_reason(_Channel()) == "no reason given"
    assert channel_close_reason(_Channel(reason=None)) == "no reason given"
    assert channel_close_reason(_Channel(reason="not an exception")) == "no reason given"


class _UnclosableConnection:
    """A ``SelectConnection`` whose close handshake never completes (a blocked broker),
    from a pika without ``_terminate_stream``."""

    is_open = True
    is_closed = False

    def __init__(self) -> None:
        self.close_requested = False

    def close(self) -> None:
        self.close_requested = True


def test_without_terminate_stream_a_stuck_connection_is_dropped_and_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=0.1)
    connection = _UnclosableConnection()
    publisher._connection = connection
    with caplog.at_level(logging.WARNING, logger="mqdedup.rabbitmq.publisher"):
        publisher.close()
    assert connection.close_requested  # the public close was asked for first
    assert publisher._connection is None and publisher._channel is None
    assert "no _terminate_stream" in caplog.text
