"""The RabbitMQ adapter's pika internals: each has a public-API fallback, used when a pika
version lacks it (docs/architecture.md, "Third-party internals in the adapters"); and what
replaced the two it no longer uses (issue 41).

The fast paths' own fallbacks (``io_frames.install`` and ``PublishFrames.open`` give
None) are tested in ``test_rabbitmq_io_frames.py`` and ``test_rabbitmq_publish_frames.py``,
and on the broker in ``tests/integration/rabbitmq``.
"""

from __future__ import annotations

import logging

import pytest

from mqdedup.rabbitmq.publisher import RabbitMQPublisher


class _UnclosableConnection:
    """A ``SelectConnection`` whose close handshake never completes (a blocked broker)."""

    is_open = True
    is_closed = False

    def __init__(self) -> None:
        self.close_requested = False

    def close(self) -> None:
        self.close_requested = True


def test_a_connection_that_cannot_close_is_dropped_and_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=0.1)
    connection = _UnclosableConnection()
    publisher._connection = connection
    with caplog.at_level(logging.WARNING, logger="mqdedup.rabbitmq.publisher"):
        publisher.close()
    assert connection.close_requested  # the public close was asked for first
    assert publisher._connection is None and publisher._channel is None
    assert "did not close; dropped" in caplog.text  # pika's _terminate_stream is not used
