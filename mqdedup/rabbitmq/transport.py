"""The RabbitMQ transport: one pika ``BlockingConnection`` owned by a dedicated I/O thread.

The I/O thread (:mod:`mqdedup.rabbitmq.io_thread`) consumes into a buffer; the worker
thread takes batches from the buffer (``fetch``) and runs the handlers, as long as they
take. Acks and nacks are handed to the I/O thread with ``add_callback_threadsafe``, the
only pika call that is safe from another thread (:class:`~mqdedup.rabbitmq.io_thread.Command`).

Every delivery carries the generation of the connection it came from: an ack for a
delivery of an older generation is dropped, never sent (its tag would name another
message on the new channel): the broker redelivers that message and mqdedup's dedup
skips it.

Dead letters go out on a publishing connection of their own
(:class:`~mqdedup.rabbitmq.dead_letters.DeadLetterPublisher`, used from the
worker thread), so a resource alarm that blocks publishers never blocks the acks.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError
from mqdedup.rabbitmq.codec import dead_letter_properties
from mqdedup.rabbitmq.dead_letters import DeadLetterPublisher
from mqdedup.rabbitmq.io_thread import AmqpToken, ConsumingConnection, noop
from mqdedup.rabbitmq.topology import Topology
from mqdedup.stopping import StopToken

__all__ = ["AmqpToken", "RabbitMQTransport"]

log = logging.getLogger(__name__)


def _handed_out_key(token: AmqpToken) -> int:
    """One int for (generation, delivery tag): AMQP delivery tags are 64-bit."""
    return token.generation << 64 | token.delivery_tag


class RabbitMQTransport(ConsumingConnection):
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
        super().__init__(
            topology,
            url,
            connection_name=connection_name,
            prefetch=prefetch,
            stop=stop,
            metrics=metrics,
            startup_timeout=startup_timeout,
            reconnect_backoff_max=reconnect_backoff_max,
            linger=linger,
            command_timeout=command_timeout,
            lag_interval=lag_interval,
        )
        # Worker thread only: deliveries handed out, not yet settled (keyed by
        # _handed_out_key: an int, which the garbage collector does not track as it
        # would a tuple), and the publishing connection of dead letters.
        self._handed_out: dict[int, None] = {}
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
        deadline = time.monotonic() + self._startup_timeout + self._command_timeout
        while not self._ready.wait(0.1):
            if self._stop_requested():
                # A stop during start-up (the broker unreachable): end the connect
                # attempts; this transport hands out nothing.
                log.info(
                    "stop requested while connecting to RabbitMQ; not consuming",
                    extra={"queue": self.queue},
                )
                self.close()
                return self
            if time.monotonic() >= deadline:
                break
        if not self._ready.is_set():
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
                connection.add_callback_threadsafe(noop)
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
        append = deliveries.append
        handed_out = self._handed_out
        for delivery in raw:
            generation, tag = delivery.token[:2]
            if generation != live:
                continue  # died with its channel; the broker redelivers it
            handed_out[generation << 64 | tag] = None  # _handed_out_key, inlined
            append(delivery)
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
        add = tags.add
        forget = self._handed_out.pop
        stale = 0
        for delivery in deliveries:
            generation, tag = delivery.token[:2]
            forget(generation << 64 | tag, None)  # _handed_out_key, inlined (hot path)
            if generation == live:
                add(tag)
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
            key = _handed_out_key(token)
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
