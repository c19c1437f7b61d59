"""Dead letters of the aio-pika transport: a publishing connection of its own, confirms.

As the pika transport's :class:`~mqdedup.rabbitmq.dead_letters.DeadLetterPublisher`: a
resource alarm blocks publishing connections, so dead letters never share the consuming
connection (its acks go on). Each copy is published with ``mandatory`` on a channel with
publisher confirms and the call returns only once the broker confirmed it. The broker's
refusals (a nack, a copy returned as unroutable twice, a channel closed for it) raise
:class:`~mqdedup.errors.DeadLetterRefusedError` with the reason; outages and timeouts
:class:`~mqdedup.errors.BrokerUnavailableError`. Coroutines, awaited through the bridge.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aio_pika
import aio_pika.exceptions as aio_errors

from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.rabbitmq.aio_topology import (
    CHANNEL_FAILURES,
    CONNECTION_FAILURES,
    declare_dead_letter_topology,
    describe_error,
)
from mqdedup.rabbitmq.topology import Topology

log = logging.getLogger(__name__)


class AioDeadLetterPublisher:
    """Publishes dead letters with confirms and ``mandatory`` (opened on first use)."""

    def __init__(
        self, url: str, topology: Topology, *, connection_name: str, timeout: float = 30.0
    ) -> None:
        self.topology = topology
        self.connection_name = connection_name
        self._url = url
        self._timeout = timeout
        self._connection: Any = None
        self._channel: Any = None

    async def publish(self, message: aio_pika.Message) -> None:
        """Publish one dead letter and wait for the broker's confirm (see the module docs)."""
        for attempt in (1, 2):
            channel = await self._open_channel()
            try:
                if self.topology.dead_letter_exchange:
                    exchange = await channel.get_exchange(
                        self.topology.dead_letter_exchange, ensure=False
                    )
                else:
                    exchange = channel.default_exchange
                await exchange.publish(
                    message,
                    routing_key=self.topology.dead_letter_routing_key,
                    mandatory=True,
                    timeout=self._timeout,
                )
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
                await self.close()
                if attempt == 2:
                    raise BrokerUnavailableError(
                        f"dead-letter publish failed: {describe_error(error)}"
                    ) from error
                continue  # a connection the broker closed while idle: once more, fresh
            return

    async def close(self) -> None:
        """Close the connection (quietly: it may be broken already)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            try:
                await asyncio.wait_for(connection.close(), self._timeout)
            except Exception as error:
                log.debug("ignoring an error closing the dead-letter connection: %r", error)

    async def _open_channel(self) -> Any:
        if self._connection is None or self._connection.is_closed:
            try:
                self._connection = await asyncio.wait_for(
                    aio_pika.connect(
                        self._url, client_properties={"connection_name": self.connection_name}
                    ),
                    self._timeout,
                )
            except CONNECTION_FAILURES as error:
                raise BrokerUnavailableError(
                    f"cannot open the dead-letter connection: {describe_error(error)}"
                ) from error
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
