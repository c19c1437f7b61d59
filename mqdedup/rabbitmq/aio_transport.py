"""The aio-pika transport: one queue consumed on the event loop, for async consumers.

It implements the same synchronous :class:`~mqdedup.consumers.transport.Transport` as
the pika transport, but only inside the greenlet bridge (:mod:`mqdedup.bridge`): each
method awaits aio-pika with :func:`~mqdedup.bridge.wait_for`, so the one Worker and
Processor run unchanged on the event loop while aio-pika's connection (heartbeats,
deliveries into the buffer, reconnects) keeps running on it. Called outside the bridge,
a method raises a clear error.

* A **robust connection** (``aio_pika.connect_robust``): after a lost connection (a
  broker restart, ``rabbitmqctl close_connection``) it reconnects every
  ``reconnect_interval`` seconds and declares the topology, the prefetch and the
  consumer again.
* Every delivery carries the AMQP channel it came from. A delivery tag names a message
  on its own channel only, so ``settle`` / ``give_back`` of a delivery whose channel
  died meanwhile send nothing: the broker redelivers it (flagged redelivered) and the
  dedup table turns it into a duplicate. Nothing is lost, nothing doubled.
* ``settle`` acknowledges after the commit with one ``basic.ack(multiple=True)`` for the
  contiguous run of the lowest unacked tags (:func:`~mqdedup.rabbitmq.codec.plan_acks`)
  and single acks for the rest; ``give_back`` nacks with requeue.
* Prefetch = the batch size (or ``prefetch``); ``fetch`` returns as soon as a batch is
  there, the broker cannot send more, or no delivery came for ``linger`` seconds.
* On a stop request it cancels its consumer and returns the buffered deliveries to the
  queue; the batch in flight is still acked until :meth:`close`. Every command of a stop
  (``basic.cancel``, closing the connections) waits at most ``STOP_TIMEOUT`` seconds, and
  none is sent on a connection that is down, so a stop ends within the Transport
  contract's bound in any state; a stop during start-up (the broker unreachable) ends the
  connect attempts at once: the transport starts unconnected and hands out nothing.
* A channel the broker closes (``consumer_timeout``: 406, a deleted queue: 404) is one
  WARNING with the broker's reply code and text, and counted in
  ``Metrics.channel_reopens`` when aio-pika reopens it (as every reconnect is); a lost
  connection is one WARNING when it is lost and one INFO with the outage's duration
  when it is back (:class:`~mqdedup.outages.OutageLog`), not a line per attempt.
* **A cluster's nodes**: ``url`` may name several nodes (a list, or URLs joined by
  commas, :func:`~mqdedup.rabbitmq.topology.split_urls`). The start connects to the first
  node that accepts a connection; when the connection is lost, every reconnect attempt
  goes to the next node of the list (the lost node last), so a consumer whose node died
  is back on a live node after one ``reconnect_interval``. The robust connection is
  pointed at the next node through its public ``url`` attribute (aio-pika 10 reconnects
  to ``connection.url``, and itself reassigns it in ``update_secret``); a connection
  without it reconnects to the same node (with a WARNING).
* Dead letters go out on a connection of their own with publisher confirms
  (:class:`~mqdedup.rabbitmq.aio_dead_letters.AioDeadLetterPublisher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
import aio_pika.exceptions as aio_errors
from aio_pika.connection import make_url

from mqdedup.bridge import in_bridge, wait_for
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.outages import OutageLog
from mqdedup.rabbitmq.aio_codec import aio_dead_letter_message, aio_to_message
from mqdedup.rabbitmq.aio_dead_letters import AioDeadLetterPublisher
from mqdedup.rabbitmq.aio_topology import (
    CHANNEL_FAILURES,
    CONNECTION_FAILURES,
    connect_first_live_node,
    declare_topology,
    describe_error,
)
from mqdedup.rabbitmq.codec import plan_acks
from mqdedup.rabbitmq.topology import BrokerNodes, Topology
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)

#: Longest single wait inside ``fetch``, so a stop request is seen promptly.
WAIT_SLICE = 0.25
#: Seconds to wait for the broker's answer to a command (declare, cancel, close).
COMMAND_TIMEOUT = 30.0
#: Seconds a command of a stop (``basic.cancel``, a connection close) may take.
STOP_TIMEOUT = 1.0
#: Longest single wait of a connect attempt at start, so a stop request is seen promptly.
START_SLICE = 0.1
#: Seconds between two reads of the queue's depth (``Metrics.lag``).
LAG_INTERVAL = 15.0


@dataclass(frozen=True, slots=True, eq=False)
class AioAmqpToken:
    """``Delivery.token`` of an aio-pika delivery: its channel, tag and original message."""

    channel: Any  # the aiormq channel it came from (a tag is only valid there)
    delivery_tag: int
    incoming: Any  # the aio_pika.IncomingMessage (kept for dead-lettering)


def require_bridge(operation: str) -> None:
    """Raise when an aio transport method is called outside the greenlet bridge."""
    if not in_bridge():
        raise RuntimeError(
            f"{operation} is an asyncio transport method: call it inside the greenlet "
            "bridge on the event loop (mqdedup.bridge.run_bridged; AsyncRabbitMQConsumer "
            "does that in run / run_async), not from plain synchronous code"
        )


class AioPikaTransport:
    """A :class:`~mqdedup.consumers.transport.Transport` over aio-pika (see the module docs)."""

    def __init__(
        self,
        topology: Topology,
        url: str | Sequence[str],
        *,
        connection_name: str,
        prefetch: int,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
        startup_timeout: float = 30.0,
        reconnect_interval: float = 1.0,
        linger: float = 0.02,
    ) -> None:
        self.topology = topology
        self.queue = topology.queue
        self.connection_name = connection_name
        self.prefetch = prefetch
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics.consumer_attached = False
        self.metrics.lag.setdefault(self.queue, 0)
        self._next_lag = 0.0
        self._nodes = BrokerNodes(url, connection_name)  # a ConfigurationError if malformed
        self._masked_url = ",".join(self._nodes.masked)
        self._stop = stop
        self._startup_timeout = startup_timeout
        self._reconnect_interval = reconnect_interval
        self._linger = linger
        self._connection: Any = None
        self._channel: Any = None
        self._queue: Any = None
        self._consumer_tag: str | None = None
        self._buffer: deque[Delivery[AioAmqpToken]] = deque()
        self._arrived: asyncio.Event | None = None
        self._last_arrival = 0.0
        #: Tags of the current channel handed out or buffered, not acked / nacked yet.
        self._outstanding: set[int] = set()
        self._outstanding_channel: Any = None
        #: Deliveries handed out and not settled / given back (for the prefetch check).
        self._handed_out = 0
        self._reconnects = 0
        self._closed = False
        self._rotation: asyncio.Future[None] | None = None
        self._outage = OutageLog(
            "rabbitmq connection",
            logger=log,
            context={"queue": self.queue, "connection_name": connection_name},
        )
        self.dead_letters = AioDeadLetterPublisher(
            self._nodes.urls, topology, connection_name=f"{connection_name}:dead-letters"
        )

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> AioPikaTransport:
        """Connect, declare the topology and start consuming (inside the bridge).

        Retries an unreachable broker for ``startup_timeout`` seconds, then raises
        :class:`BrokerUnavailableError`; wrong credentials or a queue declared with other
        arguments raise :class:`ConfigurationError` at once.
        """
        require_bridge("AioPikaTransport.start")
        if self._connection is None:
            wait_for(self._start())
        return self

    def close(self) -> None:
        """Stop consuming and close the connection; unacked deliveries return to the queue."""
        if self._closed:
            return
        require_bridge("AioPikaTransport.close")
        self._closed = True
        wait_for(self._close())

    @property
    def reconnects(self) -> int:
        """How often the connection was re-established since the start."""
        return self._reconnects

    @property
    def connected(self) -> bool:
        """True while the consuming channel is open."""
        return self._channel is not None and not self._channel.is_closed

    # -- the Transport protocol ----------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[AioAmqpToken]]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` seconds."""
        require_bridge("AioPikaTransport.fetch")
        return wait_for(self._fetch(max_messages, timeout))

    def settle(self, deliveries: Sequence[Delivery[AioAmqpToken]]) -> None:
        """Ack deliveries whose transaction committed (``multiple=True`` where contiguous).

        Deliveries of a channel that died since are not acked: they are redelivered and
        skipped as duplicates.
        """
        require_bridge("AioPikaTransport.settle")
        wait_for(self._settle(deliveries))

    def give_back(self, deliveries: Sequence[Delivery[AioAmqpToken]]) -> None:
        """Return unsettled deliveries to the queue (``basic.nack`` with requeue)."""
        require_bridge("AioPikaTransport.give_back")
        wait_for(self._give_back(deliveries))

    def dead_letter(self, delivery: Delivery[AioAmqpToken], record: DeadLetter) -> None:
        """Publish the original message with the reason headers; wait for the confirm.

        Raises :class:`~mqdedup.errors.DeadLetterRefusedError` when the broker refuses
        the copy and :class:`BrokerUnavailableError` for an outage; the processor then
        leaves the delivery unsettled.
        """
        require_bridge("AioPikaTransport.dead_letter")
        token = delivery.token
        if wait_for(self._current_channel()) is not token.channel:
            raise BrokerUnavailableError(
                "the channel of this delivery closed before it could be dead-lettered; "
                "the broker will redeliver it"
            )
        copy = aio_dead_letter_message(
            token.incoming, record, source_queue=self.queue, message_id=delivery.message.id
        )
        wait_for(self.dead_letters.publish(copy))

    def keepalive(self) -> None:
        """Nothing to do: aio-pika answers heartbeats while the loop runs."""

    # -- coroutines --------------------------------------------------------------------------

    async def _start(self) -> None:
        self._arrived = asyncio.Event()
        deadline = time.monotonic() + self._startup_timeout
        pause = 0.2
        while True:
            try:
                connection = await self._connect_first_live_node()
                if connection is None:
                    log.info(
                        "stop requested while connecting to RabbitMQ; not consuming",
                        extra={"queue": self.queue, "url": self._masked_url},
                    )
                    return
                break
            except aio_errors.ProbableAuthenticationError as error:
                raise ConfigurationError(
                    f"RabbitMQ at {self._masked_url} refused the credentials: "
                    f"{describe_error(error)}"
                ) from error
            except (aio_errors.AMQPError, OSError, TimeoutError) as error:
                if time.monotonic() + pause > deadline:
                    raise BrokerUnavailableError(
                        f"cannot connect to RabbitMQ at {self._masked_url}: {describe_error(error)}"
                    ) from error
                self._outage.down(describe_error(error), "cannot connect to RabbitMQ; retrying")
                if await self._unless_stopped(asyncio.sleep(pause, True), pause + 1) is None:
                    return
                pause = min(pause * 2, 2.0)
        self._outage.up()
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=self.prefetch)
            self._queue = await declare_topology(channel, self.topology)
            self._consumer_tag = await self._queue.consume(self._on_message, no_ack=False)
        except BaseException:
            await _quietly(connection.close())
            raise
        self._connection = connection
        self._channel = channel
        connection.reconnect_callbacks.add(self._on_reconnect)
        connection.close_callbacks.add(self._on_connection_lost)
        channel.close_callbacks.add(self._on_channel_closed)
        channel.reopen_callbacks.add(self._on_channel_reopened)
        self.metrics.consumer_attached = True
        log.info(
            "rabbitmq consumer connected (aio-pika)",
            extra={
                "queue": self.queue,
                "prefetch": self.prefetch,
                "url": self._nodes.masked[self._nodes.current],
            },
        )

    async def _connect_first_live_node(self) -> Any:
        """A robust connection to the first node that accepts one (:func:`connect_first_live_node`);
        None when a stop was requested."""

        def connect(url: str) -> Any:
            return self._unless_stopped(
                aio_pika.connect_robust(
                    url,
                    client_properties={"connection_name": self.connection_name},
                    reconnect_interval=self._reconnect_interval,
                ),
                COMMAND_TIMEOUT,
            )

        return await connect_first_live_node(self._nodes, connect)

    async def _close(self) -> None:
        if self._rotation is not None:
            self._rotation.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._cancel_consuming()
            await _quietly(connection.close(), STOP_TIMEOUT)
        self.metrics.consumer_attached = False
        self._buffer.clear()
        await self.dead_letters.close(timeout=STOP_TIMEOUT)

    async def _on_message(self, incoming: Any) -> None:
        try:
            channel = incoming.channel  # the AMQP channel it came on (raises once closed)
        except CHANNEL_FAILURES:
            return  # the channel is closing: the broker redelivers it
        if channel is not self._outstanding_channel:
            self._outstanding_channel = channel
            self._outstanding = set()
        self._outstanding.add(incoming.delivery_tag)
        self._buffer.append(
            Delivery(
                aio_to_message(self.queue, incoming),
                AioAmqpToken(channel, incoming.delivery_tag, incoming),
            )
        )
        self._last_arrival = time.monotonic()
        assert self._arrived is not None
        self._arrived.set()

    async def _fetch(self, max_messages: int, timeout: float) -> list[Delivery[AioAmqpToken]]:
        assert self._arrived is not None
        deadline = time.monotonic() + timeout
        if time.monotonic() >= self._next_lag:
            await self._update_lag()
        while True:
            if self._stopping():
                await self._cancel_consuming()
                return []
            available = len(self._buffer)
            now = time.monotonic()
            if available >= max_messages:
                break
            if available and (
                # The broker sends no more than `prefetch` unsettled deliveries.
                available + self._handed_out >= self.prefetch
                or now - self._last_arrival >= self._linger
            ):
                break
            if now >= deadline or self._closed:
                break
            wait = deadline - now
            if available:
                wait = min(wait, self._linger - (now - self._last_arrival))
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), max(min(wait, WAIT_SLICE), 0.001))
        live = await self._current_channel()
        batch: list[Delivery[AioAmqpToken]] = []
        for _ in range(min(len(self._buffer), max_messages)):
            delivery = self._buffer.popleft()
            if delivery.token.channel is live:
                batch.append(delivery)
            # else: died with its channel; the broker redelivers it
        self._handed_out += len(batch)
        return batch

    async def _settle(self, deliveries: Sequence[Delivery[AioAmqpToken]]) -> None:
        live = await self._current_channel()
        tags = {d.token.delivery_tag for d in deliveries if d.token.channel is live}
        self._handed_out = max(0, self._handed_out - len(deliveries))
        stale = len(deliveries) - len(tags)
        if stale:
            log.info(
                "not acking deliveries of a closed channel; they will be redelivered and "
                "skipped as duplicates",
                extra={"queue": self.queue, "count": stale},
            )
        if not tags or live is None or live is not self._outstanding_channel:
            return
        plan = plan_acks(self._outstanding, tags)
        try:
            if plan.multiple_up_to is not None:
                await live.basic_ack(plan.multiple_up_to, multiple=True)
                self._outstanding = {t for t in self._outstanding if t > plan.multiple_up_to}
            for tag in plan.singles:
                await live.basic_ack(tag)
                self._outstanding.discard(tag)
        except CHANNEL_FAILURES as error:
            log.warning(
                "settling failed; the deliveries will be redelivered and skipped as duplicates",
                extra={"queue": self.queue, "error": describe_error(error)},
            )

    async def _give_back(self, deliveries: Sequence[Delivery[AioAmqpToken]]) -> None:
        live = await self._current_channel()
        self._handed_out = max(0, self._handed_out - len(deliveries))
        tags = sorted(
            d.token.delivery_tag
            for d in deliveries
            if d.token.channel is live and d.token.delivery_tag in self._outstanding
        )
        if not tags or live is None:
            return
        log.info(
            "returning unsettled deliveries to the queue",
            extra={"queue": self.queue, "count": len(tags)},
        )
        await self._nack(live, tags)

    async def _nack(self, channel: Any, tags: Sequence[int]) -> None:
        try:
            for tag in tags:
                await channel.basic_nack(tag, requeue=True)
                self._outstanding.discard(tag)
        except CHANNEL_FAILURES as error:
            log.warning(
                "returning deliveries failed; the broker requeues them with the channel",
                extra={"queue": self.queue, "error": describe_error(error)},
            )

    async def _cancel_consuming(self) -> None:
        """Stop receiving (graceful stop) and return the not-yet-fetched deliveries."""
        tag, self._consumer_tag = self._consumer_tag, None
        if tag is None or self._queue is None:
            return
        live = await self._current_channel()
        if live is not None and not self._outage.ongoing:
            # Not on a connection that is down: it would wait for the reconnect.
            with contextlib.suppress(*CONNECTION_FAILURES):
                await asyncio.wait_for(self._queue.cancel(tag), STOP_TIMEOUT)
            live = await self._current_channel()
        unfetched = [d.token.delivery_tag for d in self._buffer if d.token.channel is live]
        self._buffer.clear()
        if live is not None and unfetched:
            await self._nack(live, unfetched)
        self.metrics.consumer_attached = False
        log.info(
            "stopped consuming; finishing the batch in flight",
            extra={"queue": self.queue, "returned": len(unfetched)},
        )

    async def _update_lag(self) -> None:
        """Ready messages in the queue into ``Metrics.lag`` (a passive declare)."""
        self._next_lag = time.monotonic() + LAG_INTERVAL
        channel = await self._current_channel()
        if channel is None:
            return
        try:
            declared = await asyncio.wait_for(
                channel.queue_declare(self.queue, passive=True), COMMAND_TIMEOUT
            )
        except CONNECTION_FAILURES as error:
            log.warning(
                "queue depth unavailable",
                extra={"queue": self.queue, "error": describe_error(error)},
            )
            return
        self.metrics.lag[self.queue] = int(declared.message_count or 0)

    # -- the robust connection's callbacks -------------------------------------------------

    def _on_connection_lost(self, _connection: Any, error: BaseException | None) -> None:
        # aio-pika calls this for the lost connection and again for every failed
        # reconnect attempt: one WARNING per outage (OutageLog), DEBUG for the rest.
        if self._closed:
            return
        self.metrics.consumer_attached = False
        self._outage.down(
            describe_error(error) if error is not None else "closed",
            "rabbitmq connection lost; reconnecting (unacked deliveries come back redelivered)",
        )
        self._reconnect_to_next_node(_connection)

    def _reconnect_to_next_node(self, connection: Any) -> None:
        """Point the robust connection's next attempt at the next node of a cluster."""
        if len(self._nodes) < 2 or connection is None:
            return
        if not hasattr(connection, "url"):  # not aio-pika 10's Connection: stay on the node
            log.warning(
                "cannot move the robust connection to another node; reconnecting to the same",
                extra={"queue": self.queue},
            )
            return
        if self._rotation is None or self._rotation.done():
            self._move_to_next_node(connection)
            self._rotation = asyncio.ensure_future(self._rotate_while_down(connection))

    def _move_to_next_node(self, connection: Any) -> None:
        index = self._nodes.next_node()
        connection.url = make_url(self._nodes.urls[index])
        log.debug("next reconnect attempt to %s", self._nodes.masked[index])

    async def _rotate_while_down(self, connection: Any) -> None:
        """While the connection is down, move its next attempt to the next node every
        ``reconnect_interval`` (aio-pika retries ``connection.url``; a failed attempt does
        not call the close callbacks, so this task moves it on)."""
        while True:
            await asyncio.sleep(self._reconnect_interval)
            if not self._outage.ongoing or self._closed:
                return
            self._move_to_next_node(connection)

    def _on_reconnect(self, _connection: Any) -> None:
        self._reconnects += 1
        self._handed_out = 0
        self.metrics.consumer_attached = self._consumer_tag is not None
        self._outage.up()
        if len(self._nodes) > 1:
            url = getattr(_connection, "url", None)
            self._nodes.current = next(
                (i for i, u in enumerate(self._nodes.urls) if make_url(u) == url),
                self._nodes.current,
            )
            log.info(
                "rabbitmq consumer reconnected",
                extra={"queue": self.queue, "url": self._nodes.masked[self._nodes.current]},
            )

    def _on_channel_closed(self, _channel: Any, error: BaseException | None) -> None:
        """The consuming channel closed: the broker's reason, once (a WARNING)."""
        if self._closed or self._outage.ongoing or not isinstance(error, aio_errors.ChannelClosed):
            return  # our own close, or the connection is lost (logged once by the outage)
        code, text = reply_of(error)
        self.metrics.consumer_attached = False
        log.warning(
            "the broker closed the consuming channel; reopening it (unacked deliveries come "
            "back redelivered)",
            extra={"queue": self.queue, "reply_code": code, "reply_text": text},
        )

    def _on_channel_reopened(self, _channel: Any) -> None:
        self.metrics.channel_reopens += 1
        self._handed_out = 0
        self.metrics.consumer_attached = self._consumer_tag is not None

    # -- helpers -----------------------------------------------------------------------------

    async def _current_channel(self) -> Any:
        """The open AMQP (aiormq) channel deliveries come from now, or None."""
        channel = self._channel
        if channel is None or channel.is_closed:
            return None
        try:
            underlying = await channel.get_underlay_channel()
        except (aio_errors.ChannelInvalidStateError, RuntimeError):
            return None
        return None if underlying.is_closed else underlying

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.requested

    async def _unless_stopped(self, awaitable: Any, timeout: float) -> Any:
        """Await ``awaitable`` (at most ``timeout`` s); None at once if a stop is requested."""
        task = asyncio.ensure_future(awaitable)
        deadline = time.monotonic() + timeout
        try:
            while not task.done():
                if self._stopping():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer within {timeout:g}s")
                await asyncio.wait({task}, timeout=min(left, START_SLICE))
        except BaseException:
            task.cancel()
            raise
        return task.result()


def reply_of(error: BaseException) -> tuple[int | None, str]:
    """The reply code and text of a channel the broker closed (aiormq's exception)."""
    from aiormq.channel import EXCEPTION_MAPPING

    args: tuple[Any, ...] = tuple(getattr(error, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int):
        return args[0], str(args[1])
    code = next((c for c, kind in EXCEPTION_MAPPING.items() if type(error) is kind), None)
    return code, str(args[-1]) if args else str(error)


async def _quietly(awaitable: Any, timeout: float = COMMAND_TIMEOUT) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)
    except Exception as error:
        log.debug("ignoring an error while closing a RabbitMQ connection: %r", error)
