"""Dead letters of the aio-pika transport: a publishing connection of its own, confirms.

As the pika transport's :class:`~mqdedup.rabbitmq.dead_letters.DeadLetterPublisher`: a
resource alarm blocks publishing connections, so dead letters never share the consuming
connection (its acks go on). Each copy is published with ``mandatory`` on a channel with
publisher confirms and the call returns only once the broker confirmed it. The broker's
refusals (a nack, a copy returned as unroutable twice, a channel closed for it) raise
:class:`~mqdedup.errors.DeadLetterRefusedError` with the reason; outages and timeouts
:class:`~mqdedup.errors.BrokerUnavailableError`. Coroutines, awaited through the bridge.

A publish the broker does not confirm within ``blocked_timeout`` seconds (1 s, as the
pika transport's blocked-connection timeout) is given up like a blocked one: during a
resource alarm RabbitMQ stops reading a publishing connection, so the connection is
closed (the unread copy goes with it) and publishes are refused at once for a growing
pause (1 s doubling to 5 s, reset by the next confirmed one). So a long alarm costs the
worker one short wait per pause, never the 30-second ``timeout`` per poison message,
and the acks and the next batch go on. The trade-off: a confirm slower than
``blocked_timeout`` on a healthy but overloaded broker also counts as refused; the
delivery is then dead-lettered again later and the dead-letter queue may hold two
copies with the same ``message-id`` (nothing is lost; the business effect is not
doubled). aio-pika has no public "blocked" state, so the timeout is the signal.

``url`` may name a cluster's nodes (a list, or URLs joined by commas,
:func:`~mqdedup.rabbitmq.topology.split_urls`): a connection goes to the first node that
accepts it, and after a connection failed (its node died, perhaps with the confirm) the
next one tries the other nodes first. A copy whose confirm did not arrive is never taken
as published: it is sent once more on a fresh connection or the call raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aio_pika
import aio_pika.exceptions as aio_errors

from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.rabbitmq.aio_topology import (
    CHANNEL_FAILURES,
    CONNECTION_FAILURES,
    connect_first_live_node,
    declare_dead_letter_topology,
    describe_error,
)
from mqdedup.rabbitmq.topology import BrokerNodes, Topology

log = logging.getLogger(__name__)

#: Longest pause, in seconds, between publish attempts while publishes time out (an alarm).
_BLOCKED_PAUSE_MAX = 5.0


class AioDeadLetterPublisher:
    """Publishes dead letters with confirms and ``mandatory`` (opened on first use)."""

    def __init__(
        self,
        url: str | Sequence[str],
        topology: Topology,
        *,
        connection_name: str,
        timeout: float = 30.0,
        blocked_timeout: float = 1.0,
    ) -> None:
        self.topology = topology
        self.connection_name = connection_name
        self._nodes = BrokerNodes(url, connection_name)
        self._timeout = timeout
        self._blocked_timeout = blocked_timeout
        self._connection: Any = None
        self._channel: Any = None
        self._refuse_until = 0.0
        self._pause = 1.0

    async def publish(self, message: aio_pika.Message) -> None:
        """Publish one dead letter and wait for the broker's confirm (see the module docs)."""
        if time.monotonic() < self._refuse_until:
            raise BrokerUnavailableError(
                "RabbitMQ did not confirm the last dead letter in time (a resource alarm?); "
                "the dead letter waits"
            )
        for attempt in (1, 2):
            channel = await self._open_channel()
            try:
                if self.topology.dead_letter_exchange:
                    exchange = await channel.get_exchange(
                        self.topology.dead_letter_exchange, ensure=False
                    )
                else:
                    exchange = channel.default_exchange
                await asyncio.wait_for(
                    exchange.publish(
                        message,
                        routing_key=self.topology.dead_letter_routing_key,
                        mandatory=True,
                        timeout=self._timeout,
                    ),
                    self._blocked_timeout,
                )
            except TimeoutError as error:
                await self._on_blocked_timeout()
                raise BrokerUnavailableError(
                    f"RabbitMQ did not confirm the dead letter within {self._blocked_timeout:g}s "
                    "(publishing blocked by a resource alarm?); the connection was closed and "
                    "the dead letter waits"
                ) from error
            except aio_errors.DeliveryError as error:
                returned = type(getattr(error, "frame", None)).__name__ == "Return"
                if returned and attempt == 1:
                    await self._redeclare("unroutable")
                    continue
                raise DeadLetterRefusedError(
                    f"dead letter unroutable: exchange {self.topology.dead_letter_exchange!r} "
                    f"has no binding to {self.topology.dead_letter_queue!r}"
                    if returned
                    else f"dead-letter queue {self.topology.dead_letter_queue!r} refused the "
                    "message (publisher nack: the queue is full with overflow=reject-publish, "
                    "or a policy rejects it)"
                ) from error
            except aio_errors.ChannelClosed as error:
                self._channel = None
                if isinstance(error, aio_errors.ChannelNotFoundEntity) and attempt == 1:
                    await self._redeclare(describe_error(error))
                    continue
                raise DeadLetterRefusedError(
                    f"RabbitMQ refused the dead letter: {describe_error(error)}"
                ) from error
            except CONNECTION_FAILURES as error:
                # Not confirmed: never taken as published. Its node may be dead: the next
                # connection tries a cluster's other nodes first.
                self._nodes.lost()
                await self.close()
                if attempt == 2:
                    raise BrokerUnavailableError(
                        f"dead-letter publish failed: {describe_error(error)}"
                    ) from error
                continue  # a connection the broker closed while idle: once more, fresh
            self._pause = 1.0
            return

    async def _on_blocked_timeout(self) -> None:
        if self._pause == 1.0:
            log.warning(
                "RabbitMQ does not confirm dead letters (resource alarm?); dead letters wait, "
                "acks go on",
                extra={"connection_name": self.connection_name},
            )
        self._refuse_until = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, _BLOCKED_PAUSE_MAX)
        await self.close(timeout=self._blocked_timeout)

    async def close(self, timeout: float | None = None) -> None:
        """Close the connection (quietly: it may be broken already), waiting at most
        ``timeout`` seconds (default: the blocked timeout, so a stop is never held)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            try:
                await asyncio.wait_for(connection.close(), timeout or self._blocked_timeout)
            except Exception as error:
                log.debug("ignoring an error closing the dead-letter connection: %r", error)

    async def _open_channel(self) -> Any:
        if self._connection is None or self._connection.is_closed:
            if self._connection is not None:
                self._nodes.lost()  # closed while idle: its node may be dead
            self._connection = await self._connect()
            self._channel = None
        if self._channel is None or self._channel.is_closed:
            try:
                self._channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            except CHANNEL_FAILURES as error:
                await self.close()
                raise BrokerUnavailableError(
                    f"cannot open a dead-letter channel: {describe_error(error)}"
                ) from error
        return self._channel

    async def _connect(self) -> Any:
        """A connection to the first node that accepts one (see :class:`BrokerNodes`)."""

        def connect(url: str) -> Any:
            return asyncio.wait_for(
                aio_pika.connect(url, client_properties={"connection_name": self.connection_name}),
                self._timeout,
            )

        try:
            return await connect_first_live_node(self._nodes, connect)
        except CONNECTION_FAILURES as error:
            raise BrokerUnavailableError(
                f"cannot open the dead-letter connection: {describe_error(error)}"
            ) from error

    async def _redeclare(self, why: str) -> None:
        """Declare the dead-letter queue, exchange and binding again (a publish failed)."""
        log.warning(
            "dead-letter publish failed; declaring the dead-letter queue again",
            extra={"queue": self.topology.queue, "error": why},
        )
        try:
            await declare_dead_letter_topology(await self._open_channel(), self.topology)
        except aio_errors.ChannelClosed as error:
            self._channel = None
            raise DeadLetterRefusedError(
                f"cannot declare the dead-letter queue {self.topology.dead_letter_queue!r}: "
                f"{describe_error(error)}"
            ) from error
