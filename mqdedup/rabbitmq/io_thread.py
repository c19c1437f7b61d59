"""The RabbitMQ consumer's I/O thread: connect, serve, reconnect, tear down.

Why a thread: pika's ``BlockingConnection`` only answers heartbeats while its I/O loop
runs. The I/O thread runs that loop all the time and consumes into a buffer (the worker
thread takes batches from it: :mod:`mqdedup.rabbitmq.transport`).

When the connection or the consuming channel dies (a connection loss, the broker
closing the channel: ``consumer_timeout``, 403/404/406, or cancelling the consumer:
queue deleted), the I/O thread notices it at once, reconnects with backoff (tenacity,
:mod:`mqdedup.rabbitmq.reconnecting`), declares the topology again and starts a new
generation. While no consumer is attached, ``Metrics.consumer_attached`` is False (the
worker is not ready). A topology the broker rejects when it is declared again (406
``inequivalent arg``, 403, 404) is a configuration error after a reconnect as at start:
the next ``fetch`` raises it and the worker stops.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pika

from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.io_channel import ConsumingChannel
from mqdedup.rabbitmq.io_frames import install as install_fast_path
from mqdedup.rabbitmq.io_frames import new_consumer_tag
from mqdedup.rabbitmq.reconnecting import (
    ClosingError,
    close_quietly,
    connect_retrying,
    describe,
    startup_failure,
)
from mqdedup.rabbitmq.topology import declare_topology

# The transport's logger, as before this code moved out of mqdedup.rabbitmq.transport.
log = logging.getLogger("mqdedup.rabbitmq.transport")


class _ConsumerCancelledError(Exception):
    """Internal: the broker cancelled our consumer (queue deleted, node failover)."""


class _ChannelLostError(Exception):
    """Internal: the broker closed the consuming channel (e.g. consumer_timeout, 406)."""


class ConsumingConnection(ConsumingChannel):
    """The connection lifecycle run by the I/O thread, and what it lets others observe.

    The base of :class:`~mqdedup.rabbitmq.transport.RabbitMQTransport`; not used alone.
    """

    # -- introspection -------------------------------------------------------------------

    @property
    def live_generation(self) -> int | None:
        """The generation of the open connection (None while disconnected)."""
        with self._lock:
            return self._live_generation

    @property
    def generation(self) -> int:
        """How many connections were opened so far (1 after start, +1 per reconnect)."""
        with self._lock:
            return self._generation

    @property
    def connected(self) -> bool:
        """True while a connection is open and consuming."""
        return self.live_generation is not None

    @property
    def fatal_error(self) -> BaseException | None:
        """The configuration error that stopped the transport after a reconnect, if any."""
        return self._fatal_error

    @property
    def reconnects(self) -> int:
        """How often the transport had to reconnect after losing its connection."""
        with self._lock:
            return self._reconnects

    def _raise_if_fatal(self) -> None:
        if self._fatal_error is not None:
            raise self._fatal_error

    # -- I/O thread --------------------------------------------------------------------------

    def _io_main(self) -> None:
        first = True
        while not self._closing.is_set():
            try:
                connect_retrying(
                    first,
                    startup_timeout=self._startup_timeout,
                    backoff_max=self._backoff_max,
                    closing=self._closing,
                    queue=self.queue,
                    masked_url=self._masked_url,
                )(self._connect)
            except ClosingError:
                break
            except Exception as error:
                if first:
                    # The first connection gives up (a worker that never started).
                    self._startup_error = self._startup_failure(error)
                else:
                    self._fail_after_reconnect(error)
                break
            if first:
                first = False
                self._ready.set()
            try:
                self._serve()
            except ClosingError:
                pass
            except Exception as error:
                if not self._closing.is_set():
                    log.warning(
                        "RabbitMQ consumer detached; reconnecting",
                        extra={
                            "queue": self.queue,
                            "connection_name": self.connection_name,
                            "error": describe(error),
                        },
                    )
                    with self._lock:
                        self._reconnects += 1
            finally:
                self._teardown()
            if self._stop_requested():
                break  # stopping: a new connection would only start consuming again
        self._teardown()
        self._ready.set()

    def _fail_after_reconnect(self, error: BaseException) -> None:
        """A reconnect found a configuration error: stop, and let ``fetch`` raise it."""
        failure = self._startup_failure(error)
        if not isinstance(failure, ConfigurationError):
            failure = ConfigurationError(str(failure))
        log.error(
            "RabbitMQ rejected the consumer's configuration on reconnect; stopping",
            extra={"queue": self.queue, "error": str(failure)},
        )
        with self._lock:
            self._fatal_error = failure
            self._lock.notify_all()

    def _startup_failure(self, error: BaseException) -> BaseException:
        return startup_failure(
            error,
            masked_url=self._masked_url,
            queue=self.queue,
            declare=self.topology.declare,
            startup_timeout=self._startup_timeout,
        )

    def _connect(self) -> None:
        if self._closing.is_set():
            raise ClosingError
        connection = pika.BlockingConnection(self._parameters)
        try:
            channel = connection.channel()
            declare_topology(channel, self.topology)
            channel.basic_qos(prefetch_count=self.prefetch)
            channel.add_on_cancel_callback(self._on_broker_cancel)
            admin_channel = connection.channel()
            with self._lock:
                self._generation += 1
                generation = self._generation
            self._io_generation = generation
            self._outstanding.clear()
            self._broker_cancelled = False
            self._connection = connection
            self._channel = channel
            self._admin_channel = admin_channel
            self._consumer_tag = channel.basic_consume(
                queue=self.queue,
                on_message_callback=self._on_message,
                auto_ack=False,
                consumer_tag=new_consumer_tag(channel.channel_number),
            )
            self._consuming = True
        except BaseException:
            self._connection = None
            close_quietly(connection)
            raise
        with self._lock:
            self._live_generation = generation
            self._live_connection = connection
            self._last_arrival = time.monotonic()
        self.metrics.consumer_attached = True
        if generation > 1:
            self.metrics.channel_reopens += 1
        log.info(
            "consuming from RabbitMQ",
            extra={
                "queue": self.queue,
                "url": self._masked_url,
                "connection_name": self.connection_name,
                "generation": generation,
                "prefetch": self.prefetch,
            },
        )

    def _serve(self) -> None:
        connection = self._connection
        self._decode_deliveries_ourselves(connection)
        while True:
            if self._closing.is_set():
                self._drain_commands()  # the last acks go out before the connection closes
                return
            if self._consuming and self._stop_requested():
                self._cancel_consuming()
            if self._broker_cancelled:
                raise _ConsumerCancelledError(
                    f"the broker cancelled the consumer of {self.queue!r}"
                )
            connection.process_data_events(time_limit=0.2)
            channel = self._channel
            if channel is not None and channel.is_closed:
                # Closed by the broker (consumer_timeout, 403/404/406): pika only logs it,
                # and acks on a closed channel would be dropped silently.
                raise _ChannelLostError(
                    "the broker closed the consuming channel: " + channel_close_reason(channel)
                )
            if self._lag_interval > 0 and time.monotonic() >= self._next_lag_update:
                self._update_lag()

    def _decode_deliveries_ourselves(self, connection: Any) -> None:
        """From now on, decode our deliveries without pika's layers (:mod:`.io_frames`).

        Deliveries that came in with the ``ConsumeOk`` wait as ``BlockingChannel``
        events: they are dispatched first, so the buffer keeps the broker's order (a
        ``multiple=True`` ack must never cover a tag that is not in it yet). Called once
        the generation is live: ``fetch`` hands out only deliveries of the live one.
        """
        if not self._consuming or self._consumer_tag is None:
            return
        connection.process_data_events(time_limit=0)
        self._fast_path = install_fast_path(
            connection, self._channel, self._consumer_tag, self._on_delivery
        )

    def _teardown(self) -> None:
        """Forget the connection: buffered deliveries and pending commands die with it."""
        self.metrics.consumer_attached = False
        with self._lock:
            self._live_generation = None
            self._live_connection = None
            dropped = len(self._buffer)
            self._buffer.clear()
            pending, self._pending = self._pending, []
            self._lock.notify_all()
        lost = BrokerUnavailableError("the RabbitMQ connection closed")
        for command in pending:
            command.fail(lost)
        self._outstanding.clear()
        self._consuming = False
        if dropped:
            log.info(
                "dropped buffered deliveries of a closed connection; the broker redelivers them",
                extra={"queue": self.queue, "count": dropped},
            )
        connection, self._connection = self._connection, None
        self._channel = None
        self._admin_channel = None
        self._fast_path = None
        if connection is not None:
            close_quietly(connection)


def channel_close_reason(channel: Any) -> str:
    """Why the broker closed ``channel`` (a ``BlockingChannel``), for the log line.

    pika keeps it only in ``BlockingChannel._closing_reason`` (an internal; see
    docs/architecture.md, "Third-party internals in the adapters"), e.g.
    ``ChannelClosedByBroker(406, 'PRECONDITION_FAILED - delivery acknowledgement on
    channel 1 timed out...')``; without it: "no reason given".
    """
    reason = getattr(channel, "_closing_reason", None)
    return describe(reason) if isinstance(reason, BaseException) else "no reason given"
