"""Async RabbitMQ consumers: subclass :class:`AsyncRabbitMQConsumer`, ``async def handle``.

::

    class OrderConsumer(AsyncRabbitMQConsumer):
        queue = "orders"

        async def handle(self, message, ctx):
            await ctx.session.execute(insert(orders).values(...))

The class attributes are those of :class:`~mqdedup.rabbitmq.consumer.RabbitMQConsumer`
(queue, bindings, queue_type, prefetch, url, dead_letter_queue, ...), and so is the
transport: the same :class:`~mqdedup.rabbitmq.transport.RabbitMQTransport` (pika, its own
I/O thread), driven from the event loop through
:class:`~mqdedup.consumers.bridged_transport.BridgedTransport` (see ``docs/asyncio.md``).
"""

from __future__ import annotations

from typing import ClassVar

from mqdedup.consumers.async_consumer import AsyncConsumer
from mqdedup.consumers.bridged_transport import BridgedTransport
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError
from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.topology import default_connection_name
from mqdedup.rabbitmq.transport import AmqpToken, RabbitMQTransport
from mqdedup.stopping import StopToken


class AsyncRabbitMQConsumer(AsyncConsumer, RabbitMQConsumer):
    """A RabbitMQ consumer run on an asyncio event loop (see the module docs).

    ``async def handle`` / ``handle_batch`` get a guarded ``AsyncSession``
    (:class:`~mqdedup.consumers.async_consumer.AsyncConsumer`); ``run`` (what
    ``mqdedup worker`` calls) runs an event loop of its own, ``await run_async(...)``
    runs on yours.
    """

    #: Longest wait between reconnect attempts, in seconds (at most
    #: ``reconnect_backoff_max``): the async consumer reconnects at least this often.
    reconnect_interval: ClassVar[float] = 1.0

    def validate(self) -> None:
        """Check the class attributes; raise ConfigurationError naming the problem."""
        super().validate()
        if self.reconnect_interval <= 0:
            raise ConfigurationError(f"{type(self).__name__}.reconnect_interval must be positive")

    def create_transport(  # type: ignore[override]
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> BridgedTransport[AmqpToken]:
        """Connect, declare the topology and start consuming: the pika transport, driven
        from the event loop (its start, fetch waits, dead letters and close run in a
        thread).

        ``stop``: when requested, the transport stops consuming and returns its buffered
        deliveries, while the batch in flight is still acked.
        """
        self.validate()
        transport = RabbitMQTransport(
            self.topology(),
            self.broker_url,
            connection_name=self.connection_name or default_connection_name(self.consumer_name),
            prefetch=self.effective_prefetch,
            stop=stop,
            metrics=metrics,
            startup_timeout=self.startup_timeout,
            reconnect_backoff_max=min(self.reconnect_interval, self.reconnect_backoff_max),
        )
        return BridgedTransport.start(transport.start, name=f"rabbitmq:{self.queue}")
