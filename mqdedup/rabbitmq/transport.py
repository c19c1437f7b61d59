"""The RabbitMQ transport: one pika ``BlockingConnection`` owned by a dedicated I/O thread.

Why a thread: pika's ``BlockingConnection`` only answers heartbeats while its I/O loop
runs. The I/O thread runs that loop all the time and consumes into a buffer; the worker
thread takes batches from the buffer (``fetch``) and runs the handlers, as long as they
take. Acks, nacks and dead-letter publishes are handed to the I/O thread with
``add_callback_threadsafe``, the only pika call that is safe from another thread.

Every connection gets a *generation* number and every delivery carries the generation
it came from. When the connection or the consuming channel dies (a connection loss,
the broker closing the channel: ``consumer_timeout``, 403/404/406, or cancelling the
consumer: queue deleted), the I/O thread notices it at once, reconnects with backoff
(tenacity), declares the topology again and starts a new generation; an ack for a
delivery of an older generation is dropped, never sent (its tag would name another
message on the new channel): the broker redelivers that message and mqdedup's dedup
skips it. While no consumer is attached, ``Metrics.consumer_attached`` is False (the
worker is not ready). A topology the broker rejects when it is declared again (406
``inequivalent arg``, 403, 404) is a configuration error after a reconnect as at start:
the next ``fetch`` raises it and the worker stops.

Dead letters go out on a publishing connection of their own
(:class:`~mqdedup.rabbitmq.publishing.DeadLetterPublisher`, used from the
worker thread), so a resource alarm that blocks publishers never blocks the acks.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    stop_never,
    wait_random_exponential,
)

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.codec import (
    dead_letter_properties,
    plan_acks,
    to_message,
)
from mqdedup.rabbitmq.publishing import DeadLetterPublisher
from mqdedup.rabbitmq.topology import (
    Topology,
    connection_parameters,
    declare_topology,
    mask_amqp_url,
)
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)

#: Channel-close reply codes that mean "your configuration is wrong", not "try again".
_CONFIGURATION_REPLY_CODES = frozenset({403, 404, 406})
_DEFAULT_BLOCKED_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class AmqpToken:
    """``Delivery.token`` of a RabbitMQ delivery: where to ack it and what it looked like."""

    generation: int
    delivery_tag: int
    exchange: str
    routing_key: str
    properties: Any  # the original pika.BasicProperties (kept for dead-lettering)


class _ClosingError(Exception):
    """Internal: the transport is closing; abandon the reconnect loop."""


class _ConsumerCancelledError(Exception):
    """Internal: the broker cancelled our consumer (queue deleted, node failover)."""


class _ChannelLostError(Exception):
    """Internal: the broker closed the consuming channel (e.g. consumer_timeout, 406)."""


class _Command:
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
        try:
            self.result = self.action()
        except Exception as error:
            self.error = error
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class RabbitMQTransport:
    """A :class:`~mqdedup.consumers.transport.Transport` over one RabbitMQ queue.

    ``fetch`` returns up to ``max_messages`` buffered deliveries: as soon as that many
    are there, when the broker cannot send more (``prefetch`` unacked), when no new one
    arrived for ``linger`` seconds, or at the timeout. ``give_back`` releases deliveries
    that will not be settled (``basic.nack`` with requeue, sent by the I/O thread), so
    they are delivered again and never hold a prefetch slot for good. When ``stop`` is
    requested the transport stops consuming (``basic.cancel``) and returns its buffered,
    not yet fetched deliveries to the queue; acks of the batch in flight still go out
    until :meth:`close`.
    """

    def __init__(
        self,
        topology: Topology,
        url: str,
        *,
        connection_name: str,
        prefetch: int,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
        startup_timeout: float = 30.0,
        reconnect_backoff_max: float = 10.0,
        linger: float = 0.02,
        command_timeout: float = 30.0,
        lag_interval: float = 15.0,
        dead_letter_blocked_timeout: float = 1.0,
    ) -> None:
        self.topology = topology
        self.queue = topology.queue
        self._url = url
        self._masked_url = mask_amqp_url(url)
        self._parameters = connection_parameters(url, connection_name)
        if self._parameters.blocked_connection_timeout is None:
            self._parameters.blocked_connection_timeout = _DEFAULT_BLOCKED_TIMEOUT
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
        self._buffer: deque[tuple[int, Any, Any, bytes]] = deque()
        self._pending: list[_Command] = []
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
        self._consuming = False
        self._broker_cancelled = False
        self._io_generation = 0
        self._outstanding: set[int] = set()
        self._next_lag_update = 0.0

        # Worker thread only: (generation, tag) of deliveries handed out, not yet settled,
        # and the publishing connection of dead letters.
        self._handed_out: dict[tuple[int, int], None] = {}
        self._dead_letters = DeadLetterPublisher(
            url,
            topology,
            connection_name=f"{connection_name}:dead-letters",
            blocked_timeout=dead_letter_blocked_timeout,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> RabbitMQTransport:
        """Connect, declare the topology and start consuming; return ``self``.

        Retries an unreachable broker for ``startup_timeout`` seconds, then raises
        :class:`BrokerUnavailableError`; wrong credentials or a queue declared with other
        arguments raise :class:`ConfigurationError` at once.
        """
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._io_main, name=f"mqdedup-rabbitmq-io[{self.queue}]", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(self._startup_timeout + self._command_timeout):
            self.close()
            raise BrokerUnavailableError(
                f"RabbitMQ at {self._masked_url} did not answer within {self._startup_timeout:.0f}s"
            )
        if self._startup_error is not None:
            self._thread.join(timeout=5)
            raise self._startup_error
        return self

    def close(self) -> None:
        """Stop consuming and close the connection; unacked deliveries return to the queue."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connection = self._live_connection
            self._lock.notify_all()
        self._closing.set()
        if connection is not None:
            try:
                connection.add_callback_threadsafe(_noop)
            except Exception:  # already closed: the I/O thread is not blocked in it
                log.debug("wake-up of a closed connection ignored")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():
                log.warning(
                    "RabbitMQ I/O thread did not stop in time; abandoning it",
                    extra={"queue": self.queue},
                )
        self._dead_letters.close()

    # -- Transport protocol --------------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[AmqpToken]]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` seconds.

        Raises :class:`ConfigurationError` when the broker rejected the topology on a
        reconnect (the worker stops with it).
        """
        self._raise_if_fatal()
        self._dead_letters.service()
        deadline = time.monotonic() + timeout
        with self._lock:
            self._wanted = max_messages
            try:
                while True:
                    available = len(self._buffer)
                    if available >= max_messages:
                        break
                    now = time.monotonic()
                    if available and (
                        # The broker sends no more than `prefetch` unsettled deliveries.
                        available + len(self._handed_out) >= self.prefetch
                        or now - self._last_arrival >= self._linger
                    ):
                        break
                    if (
                        now >= deadline
                        or self._closed
                        or self._stop_requested()
                        or self._fatal_error is not None
                    ):
                        break
                    wait = deadline - now
                    if available:
                        wait = min(wait, self._linger - (now - self._last_arrival))
                    self._lock.wait(max(wait, 0.001))
                live = self._live_generation
                if self._stop_requested():
                    # Stopping: the I/O thread returns the buffer to the queue.
                    raw = []
                else:
                    raw = [
                        self._buffer.popleft() for _ in range(min(len(self._buffer), max_messages))
                    ]
            finally:
                self._wanted = 1 << 30
        deliveries: list[Delivery[AmqpToken]] = []
        for generation, method, properties, body in raw:
            if generation != live:
                continue  # died with its channel; the broker redelivers it
            token = AmqpToken(
                generation, method.delivery_tag, method.exchange, method.routing_key, properties
            )
            self._handed_out[(generation, method.delivery_tag)] = None
            deliveries.append(Delivery(to_message(self.queue, method, properties, body), token))
        return deliveries

    def settle(self, deliveries: Sequence[Delivery[AmqpToken]]) -> None:
        """Ack deliveries whose transaction committed (``multiple=True`` where contiguous).

        Deliveries from a channel that has died since are dropped: they are redelivered
        and deduplicated. The acks are handed to the I/O thread, which sends them in
        order, before anything queued later and before the connection is closed; this
        call does not wait for them (an ack has no reply in AMQP anyway).
        """
        live = self.live_generation
        tags: set[int] = set()
        stale = 0
        for delivery in deliveries:
            token = delivery.token
            self._handed_out.pop((token.generation, token.delivery_tag), None)
            if token.generation == live:
                tags.add(token.delivery_tag)
            else:
                stale += 1
        if stale:
            log.info(
                "not acking deliveries of a closed channel; they will be redelivered and "
                "skipped as duplicates",
                extra={"queue": self.queue, "count": stale},
            )
        if not tags or live is None:
            return
        command = self._submit(
            functools.partial(self._ack, live, sorted(tags)), live, "ack", detached=True
        )
        if command is None:
            log.info(
                "connection lost before the acks; the deliveries will be redelivered and "
                "skipped as duplicates",
                extra={"queue": self.queue, "count": len(tags)},
            )

    def dead_letter(self, delivery: Delivery[AmqpToken], record: DeadLetter) -> None:
        """Publish the original message with the reason headers to the dead-letter queue.

        Uses publisher confirms and ``mandatory`` on the worker's publishing connection
        (not the consuming one); returns only once the broker has confirmed the copy.
        Raises :class:`DeadLetterRefusedError` with the broker's reason when the broker
        refuses this record (nack, unroutable, channel closed for it), and
        :class:`BrokerUnavailableError` for an outage or a resource alarm; the
        processor then leaves the delivery unsettled or keeps it elsewhere.
        """
        self._raise_if_fatal()
        token = delivery.token
        live = self.live_generation
        if live is None or token.generation != live:
            raise BrokerUnavailableError(
                "the channel of this delivery closed before it could be dead-lettered; "
                "the broker will redeliver it"
            )
        properties = dead_letter_properties(
            token.properties,
            record,
            source_queue=self.queue,
            message_id=delivery.message.id,
        )
        self._dead_letters.publish(delivery.message.body, properties)

    def give_back(self, deliveries: Sequence[Delivery[AmqpToken]]) -> None:
        """Return unsettled deliveries to the queue (``basic.nack`` with requeue).

        The nacks are handed to the I/O thread; the broker delivers the messages again
        (marked redelivered; RabbitMQ puts a requeued message back at its original
        position where it can). Deliveries of a channel that died meanwhile are skipped:
        the broker has requeued them already.
        """
        live = self.live_generation
        tags: list[int] = []
        for delivery in deliveries:
            token = delivery.token
            key = (token.generation, token.delivery_tag)
            if key not in self._handed_out:
                continue  # settled or given back already
            del self._handed_out[key]
            if token.generation == live:
                tags.append(token.delivery_tag)
        if not tags or live is None:
            return
        log.info(
            "returning unsettled deliveries to the queue",
            extra={"queue": self.queue, "count": len(tags)},
        )
        self._submit(functools.partial(self._nack, live, sorted(tags)), live, "nack", detached=True)

    def keepalive(self) -> None:
        """Nothing to do: the I/O thread answers heartbeats all the time."""

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

    # -- worker-side helpers -------------------------------------------------------------

    def _stop_requested(self) -> bool:
        return self._stop is not None and self._stop.requested

    def _raise_if_fatal(self) -> None:
        if self._fatal_error is not None:
            raise self._fatal_error

    def _submit(
        self,
        action: Callable[[], Any],
        generation: int,
        description: str,
        *,
        detached: bool = False,
    ) -> _Command | None:
        """Queue ``action`` for the I/O thread if ``generation`` is still live."""
        command = _Command(action, description, detached)
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
                self._retrying(first)(self._connect)
            except _ClosingError:
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
            except _ClosingError:
                pass
            except Exception as error:
                if not self._closing.is_set():
                    log.warning(
                        "RabbitMQ consumer detached; reconnecting",
                        extra={
                            "queue": self.queue,
                            "connection_name": self.connection_name,
                            "error": _describe(error),
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

    def _retrying(self, first: bool) -> Retrying:
        """Backoff for (re)connecting: bounded by ``startup_timeout`` only the first time."""
        return Retrying(
            retry=retry_if_exception(lambda error: self._retry_connect(error, first)),
            wait=wait_random_exponential(multiplier=0.2, max=self._backoff_max),
            stop=stop_after_delay(self._startup_timeout) if first else stop_never,
            sleep=self._sleep_unless_closing,
            before_sleep=self._log_connect_retry,
            reraise=True,
        )

    def _retry_connect(self, error: BaseException, first: bool) -> bool:
        if isinstance(error, _ClosingError):
            return False
        if first:
            return not _is_configuration_error(error)
        # After a reconnect a refused login may be a broker still booting: retried. A
        # topology the broker rejects will not change by itself: a configuration error.
        return not _is_topology_error(error)

    def _sleep_unless_closing(self, seconds: float) -> None:
        if self._closing.wait(seconds):
            raise _ClosingError

    def _log_connect_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.log(
            logging.ERROR
            if error is not None and _is_configuration_error(error)
            else logging.WARNING,
            "cannot connect to RabbitMQ; retrying",
            extra={
                "queue": self.queue,
                "url": self._masked_url,
                "attempt": state.attempt_number,
                "error": _describe(error) if error is not None else None,
            },
        )

    def _startup_failure(self, error: BaseException) -> BaseException:
        if isinstance(error, ConfigurationError | BrokerUnavailableError):
            return error
        if isinstance(
            error,
            pika.exceptions.ProbableAuthenticationError
            | pika.exceptions.ProbableAccessDeniedError
            | pika.exceptions.AuthenticationError,
        ):
            return ConfigurationError(
                f"RabbitMQ at {self._masked_url} refused the login: {_describe(error)} "
                "(check the user, password and virtual host)"
            )
        if isinstance(error, pika.exceptions.ChannelClosedByBroker):
            return ConfigurationError(
                f"RabbitMQ at {self._masked_url} rejected the topology of queue "
                f"{self.queue!r}: {_describe(error)}"
                + (
                    " (declare=False: the queue, dead-letter queue and exchanges must exist)"
                    if not self.topology.declare
                    else ""
                )
            )
        return BrokerUnavailableError(
            f"cannot connect to RabbitMQ at {self._masked_url} within "
            f"{self._startup_timeout:.0f}s: {_describe(error)}"
        )

    def _connect(self) -> None:
        if self._closing.is_set():
            raise _ClosingError
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
                queue=self.queue, on_message_callback=self._on_message, auto_ack=False
            )
            self._consuming = True
        except BaseException:
            self._connection = None
            _close_quietly(connection)
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
                reason = getattr(channel, "_closing_reason", None)
                raise _ChannelLostError(
                    "the broker closed the consuming channel: "
                    + (_describe(reason) if reason is not None else "no reason given")
                )
            if self._lag_interval > 0 and time.monotonic() >= self._next_lag_update:
                self._update_lag()

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
        if connection is not None:
            _close_quietly(connection)

    # pika callbacks and commands (I/O thread) -----------------------------------------------

    def _on_message(self, _channel: Any, method: Any, properties: Any, body: bytes) -> None:
        self._outstanding.add(method.delivery_tag)
        with self._lock:
            self._buffer.append((self._io_generation, method, properties, body))
            self._last_arrival = time.monotonic()
            if len(self._buffer) >= min(self._wanted, self.prefetch):
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
                        "error": _describe(command.error),
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
        if self._consumer_tag is not None and self._channel is not None:
            self._channel.basic_cancel(self._consumer_tag)
        with self._lock:
            unfetched = [
                method.delivery_tag
                for generation, method, _properties, _body in self._buffer
                if generation == self._io_generation
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
                "queue depth unavailable", extra={"queue": self.queue, "error": _describe(error)}
            )
            return
        self.metrics.lag[self.queue] = int(frame.method.message_count)


def _noop() -> None:
    """Wakes the I/O loop."""


def _close_quietly(connection: Any) -> None:
    try:
        if connection.is_open:
            connection.close()
    except Exception as error:
        log.debug("ignoring error while closing a RabbitMQ connection: %r", error)


def _is_configuration_error(error: BaseException) -> bool:
    if isinstance(
        error,
        ConfigurationError
        | pika.exceptions.ProbableAuthenticationError
        | pika.exceptions.ProbableAccessDeniedError
        | pika.exceptions.AuthenticationError,
    ):
        return True
    return (
        isinstance(error, pika.exceptions.ChannelClosedByBroker)
        and error.reply_code in _CONFIGURATION_REPLY_CODES
    )


def _is_topology_error(error: BaseException) -> bool:
    """The broker rejected a declaration (mismatch 406, not allowed 403, missing 404)."""
    return isinstance(error, ConfigurationError) or (
        isinstance(error, pika.exceptions.ChannelClosedByBroker)
        and error.reply_code in _CONFIGURATION_REPLY_CODES
    )


def _describe(error: BaseException) -> str:
    """A one-line description of a pika / socket error (never contains credentials)."""
    if isinstance(error, pika.exceptions.ChannelClosed | pika.exceptions.ConnectionClosed):
        return f"{type(error).__name__}({error.reply_code}, {error.reply_text!r})"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
