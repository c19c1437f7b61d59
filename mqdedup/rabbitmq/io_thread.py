"""The RabbitMQ consumer's I/O thread: connect, consume into a buffer, serve the worker's
commands, reconnect, tear down.

Why a thread: pika's ``BlockingConnection`` only answers heartbeats while its I/O loop
runs. The I/O thread runs that loop all the time and consumes into a buffer; the worker
thread takes batches from it (:mod:`mqdedup.rabbitmq.transport`, whose
``RabbitMQTransport`` is the worker's side of :class:`ConsumingConnection`). The worker
thread hands acks, nacks and other work to the I/O thread as a :class:`Command`, woken
with pika's ``add_callback_threadsafe`` (the only pika call that is safe from another
thread); the I/O thread runs it on its own connection.

Every connection gets a *generation* number and every delivery carries the generation
it came from: an ack or nack for a delivery of an older generation is dropped, never
sent (its tag would name another message on the new channel).

When the connection or the consuming channel dies (a connection loss, the broker
closing the channel: ``consumer_timeout``, 403/404/406, or cancelling the consumer:
queue deleted), the I/O thread notices it at once, reconnects with backoff (tenacity,
:mod:`mqdedup.rabbitmq.reconnecting`), declares the topology again and starts a new
generation. While no consumer is attached, ``Metrics.consumer_attached`` is False (the
worker is not ready). A topology the broker rejects when it is declared again (406
``inequivalent arg``, 403, 404) is a configuration error after a reconnect as at start:
the next ``fetch`` raises it and the worker stops.

The consuming channel's deliveries are decoded by :mod:`mqdedup.rabbitmq.io_frames`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import pika
import pika.exceptions

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import Delivery, new_delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.codec import delivery_message, plan_acks
from mqdedup.rabbitmq.io_frames import DeliveryFastPath, from_pika, new_consumer_tag
from mqdedup.rabbitmq.io_frames import install as install_fast_path
from mqdedup.rabbitmq.reconnecting import (
    ClosingError,
    close_quietly,
    connect_retrying,
    describe,
    startup_failure,
)
from mqdedup.rabbitmq.topology import (
    BrokerNodes,
    Topology,
    declare_topology,
    mask_amqp_url,
)
from mqdedup.stopping import StopToken

log = logging.getLogger("mqdedup.rabbitmq.transport")

_DEFAULT_BLOCKED_TIMEOUT = 60.0


class AmqpToken(NamedTuple):
    """``Delivery.token`` of a RabbitMQ delivery: where to ack it and what it looked like.

    A named tuple, not a frozen dataclass: one is built per delivery (0.3 µs against
    about 1.5 µs for the dataclass built field by field).
    """

    generation: int
    delivery_tag: int
    exchange: str
    routing_key: str
    properties: Any  # the original pika.BasicProperties (kept for dead-lettering)


class Command:
    """Work for the I/O thread. The worker thread waits for it (bounded), unless it is
    ``detached`` (acks, nacks): then a failure is only logged by the I/O thread."""

    __slots__ = ("action", "description", "detached", "done", "error", "result")

    def __init__(
        self, action: Callable[[], Any], description: str = "", detached: bool = False
    ) -> None:
        self.action = action
        self.description = description
        self.detached = detached
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        """Run the action on the I/O thread, keeping its result or error."""
        try:
            self.result = self.action()
        except Exception as error:
            self.error = error
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        """Give up on a command that will never run (its connection closed)."""
        if not self.done.is_set():
            self.error = error
            self.done.set()


def noop() -> None:
    """Wakes the I/O loop."""


class _ConsumerCancelledError(Exception):
    """Internal: the broker cancelled our consumer (queue deleted, node failover)."""


class _ChannelLostError(Exception):
    """Internal: the broker closed the consuming channel (e.g. consumer_timeout, 406)."""


class ConsumingConnection:
    """The consumer's connection as the I/O thread runs it, and the state it shares with
    the worker thread (guarded by ``_lock``).

    The base of :class:`~mqdedup.rabbitmq.transport.RabbitMQTransport`; not used alone.
    """

    def __init__(
        self,
        topology: Topology,
        url: str,
        *,
        connection_name: str,
        prefetch: int,
        stop: StopToken | None,
        metrics: Metrics | None,
        startup_timeout: float,
        reconnect_backoff_max: float,
        linger: float,
        command_timeout: float,
        lag_interval: float,
    ) -> None:
        self.topology = topology
        self.queue = topology.queue
        self._masked_url = mask_amqp_url(url)
        # One URL, or a cluster's node URLs: a lost connection reconnects to the next node.
        self._nodes = BrokerNodes(url, connection_name)
        for parameters in self._nodes.parameters:
            if parameters.blocked_connection_timeout is None:
                parameters.blocked_connection_timeout = _DEFAULT_BLOCKED_TIMEOUT
        self.connection_name = connection_name
        self.prefetch = prefetch
        self._stop = stop
        self.metrics = metrics or Metrics()
        # The key exists before the I/O thread updates it, so that a snapshot taken on
        # another thread never iterates a dict that changes size.
        self.metrics.lag.setdefault(self.queue, 0)
        self.metrics.consumer_attached = False
        self._startup_timeout = startup_timeout
        self._backoff_max = reconnect_backoff_max
        self._linger = linger
        self._command_timeout = command_timeout
        self._lag_interval = lag_interval

        # Shared between the threads, guarded by _lock.
        self._lock = threading.Condition()
        #: Deliveries received, not yet fetched (built on the I/O thread, which has time
        #: to spare while the worker waits for its database).
        self._buffer: deque[Delivery[AmqpToken]] = deque()
        self._pending: list[Command] = []
        self._generation = 0
        self._live_generation: int | None = None
        self._live_connection: Any = None
        self._wanted = 1 << 30
        self._last_arrival = 0.0
        self._reconnects = 0

        # Lifecycle.
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # A configuration error found after a reconnect: the next fetch raises it.
        self._fatal_error: BaseException | None = None

        # I/O thread only.
        self._connection: Any = None
        self._channel: Any = None
        self._admin_channel: Any = None  # passive declares (queue depth); never publishes
        self._consumer_tag: str | None = None
        self._fast_path: DeliveryFastPath | None = None
        self._consuming = False
        self._broker_cancelled = False
        self._io_generation = 0
        self._outstanding: set[int] = set()
        self._next_lag_update = 0.0

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

    # -- worker-side helpers -------------------------------------------------------------

    def _stop_requested(self) -> bool:
        return self._stop is not None and self._stop.requested

    def _submit(
        self,
        action: Callable[[], Any],
        generation: int,
        description: str,
        *,
        detached: bool = False,
    ) -> Command | None:
        """Queue ``action`` for the I/O thread if ``generation`` is still live."""
        command = Command(action, description, detached)
        with self._lock:
            if self._live_generation != generation or self._live_connection is None:
                return None
            self._pending.append(command)
            connection = self._live_connection
        try:
            connection.add_callback_threadsafe(self._drain_commands)
        except Exception:
            # The connection closed meanwhile; teardown fails every pending command.
            log.debug("could not wake the I/O thread; the connection is closing")
        return command

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
                            "node": self._nodes.masked[self._nodes.current],
                            "error": describe(error),
                        },
                    )
                    self._nodes.lost()  # try the other nodes of a cluster first
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
        connection = self._nodes.connect()
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
            self._nodes.lost()  # e.g. a node that cannot reach the queue's leader yet
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
                "url": self._nodes.masked[self._nodes.current],
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
                    "the broker closed the consuming channel: " + self._channel_close_reason()
                )
            if self._lag_interval > 0 and time.monotonic() >= self._next_lag_update:
                self._update_lag()

    def _channel_close_reason(self) -> str:
        """The broker's reason, as the fast path read it from its ``channel.close`` (pika
        keeps it in no public place); without the fast path, pika's own WARNING
        ("Received remote Channel.Close") names it."""
        reason = None if self._fast_path is None else self._fast_path.closed_by_broker
        if reason is None:
            return "its reason is in pika's warning 'Received remote Channel.Close'"
        return describe(reason)

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

    # -- pika callbacks and commands (I/O thread) ---------------------------------------

    def _on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        """pika's consumer callback (when the fast path of :mod:`.io_frames` is not used)."""
        from_pika(self._on_delivery, channel, method, properties, body)

    def _on_delivery(
        self,
        delivery_tag: int,
        redelivered: bool,
        exchange: Any,
        routing_key: Any,
        properties: Any,
        body: bytes,
    ) -> None:
        # One call per delivery: the append needs no lock (a deque's append and the
        # worker's popleft are atomic; only this thread clears the buffer); the lock is
        # taken to wake the worker, which checks the buffer under it before it waits, so
        # waking it once, as the buffer reaches what it waits for, is enough.
        self._outstanding.add(delivery_tag)
        self._last_arrival = time.monotonic()
        buffer = self._buffer
        buffer.append(
            new_delivery(
                delivery_message(self.queue, redelivered, exchange, routing_key, properties, body),
                AmqpToken(self._io_generation, delivery_tag, exchange, routing_key, properties),
            )
        )
        if len(buffer) == min(self._wanted, self.prefetch):
            with self._lock:
                self._lock.notify_all()

    def _on_broker_cancel(self, _frame: Any) -> None:
        self._broker_cancelled = True

    def _drain_commands(self) -> None:
        with self._lock:
            commands, self._pending = self._pending, []
        for command in commands:
            command.run()
            if command.detached and command.error is not None:
                log.warning(
                    "settling failed; the deliveries will be redelivered and skipped as duplicates",
                    extra={
                        "queue": self.queue,
                        "command": command.description,
                        "error": describe(command.error),
                    },
                )

    def _ack(self, generation: int, tags: list[int]) -> int:
        if generation != self._io_generation or self._channel is None or not self._channel.is_open:
            return 0
        plan = plan_acks(self._outstanding, tags)
        if plan.multiple_up_to is not None:
            self._channel.basic_ack(delivery_tag=plan.multiple_up_to, multiple=True)
            self._outstanding.difference_update(
                [tag for tag in self._outstanding if tag <= plan.multiple_up_to]
            )
        for tag in plan.singles:
            self._channel.basic_ack(delivery_tag=tag)
            self._outstanding.discard(tag)
        return plan.frames

    def _nack(self, generation: int, tags: list[int]) -> None:
        if generation != self._io_generation or self._channel is None or not self._channel.is_open:
            return
        for tag in tags:
            if tag in self._outstanding:
                self._channel.basic_nack(delivery_tag=tag, requeue=True)
                self._outstanding.discard(tag)

    def _cancel_consuming(self) -> None:
        """Stop receiving (graceful stop) and return the not-yet-fetched deliveries."""
        self._consuming = False
        if self._fast_path is not None:
            self._fast_path.active = False  # pika rejects what still arrives for us
        if self._consumer_tag is not None and self._channel is not None:
            self._channel.basic_cancel(self._consumer_tag)
        with self._lock:
            unfetched = [
                delivery.token.delivery_tag
                for delivery in self._buffer
                if delivery.token.generation == self._io_generation
            ]
            self._buffer.clear()
            self._lock.notify_all()
        self._nack(self._io_generation, unfetched)
        log.info(
            "stopped consuming; finishing the batch in flight",
            extra={"queue": self.queue, "returned": len(unfetched)},
        )

    def _admin_channel_open(self) -> Any:
        channel = self._admin_channel
        if channel is None or not channel.is_open:
            channel = self._connection.channel()
            self._admin_channel = channel
        return channel

    def _update_lag(self) -> None:
        self._next_lag_update = time.monotonic() + self._lag_interval
        try:
            frame = self._admin_channel_open().queue_declare(queue=self.queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as error:
            log.warning(
                "queue depth unavailable", extra={"queue": self.queue, "error": describe(error)}
            )
            return
        self.metrics.lag[self.queue] = int(frame.method.message_count)
