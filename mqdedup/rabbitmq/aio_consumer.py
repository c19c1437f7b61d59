"""Async RabbitMQ consumers (aio-pika): subclass :class:`AsyncRabbitMQConsumer`.

::

    class OrderConsumer(AsyncRabbitMQConsumer):
        queue = "orders"

        async def handle(self, message, ctx):
            await ctx.session.execute(insert(orders).values(...))

The class attributes are those of :class:`~mqdedup.rabbitmq.consumer.RabbitMQConsumer`
(queue, bindings, queue_type, prefetch, url, dead_letter_queue, ...); the topology is
declared the same way. The transport is
:class:`~mqdedup.rabbitmq.aio_transport.AioPikaTransport`, run inside the greenlet bridge
on the event loop (see ``docs/asyncio.md``). aio-pika is imported only when a transport
is created (the ``asyncio`` extra), so ``import mqdedup.rabbitmq`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from mqdedup.consumers.async_consumer import AsyncConsumer
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError
from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.topology import default_connection_name
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.rabbitmq.aio_transport import AioPikaTransport


class AsyncRabbitMQConsumer(AsyncConsumer, RabbitMQConsumer):
    """A RabbitMQ consumer run on an asyncio event loop through aio-pika.

    ``async def handle`` / ``handle_batch`` get a guarded ``AsyncSession``
    (:class:`~mqdedup.consumers.async_consumer.AsyncConsumer`); ``run`` (what
    ``mqdedup worker`` calls) runs an event loop of its own, ``await run_async(...)``
    runs on yours.
    """

    #: Seconds between reconnect attempts of the robust connection (at most
    #: ``reconnect_backoff_max``).
    reconnect_interval: ClassVar[float] = 1.0

    def validate(self) -> None:
        """Check the class attributes; raise ConfigurationError naming the problem."""
        super().validate()
        if self.reconnect_interval <= 0:
            raise ConfigurationError(f"{type(self).__name__}.reconnect_interval must be positive")

    def create_transport(  # type: ignore[override]
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> AioPikaTransport:
        """Connect (robustly), declare the topology and start consuming, inside the bridge.

        ``stop``: when requested, the transport stops consuming and returns its buffered
        deliveries, while the batch in flight is still acked.
        """
        try:  # the asyncio extra
            from mqdedup.rabbitmq.aio_transport import AioPikaTransport
        except ImportError as error:
            raise ConfigurationError(
                "async RabbitMQ consumers need aio-pika: pip install 'mqdedup[asyncio]'"
            ) from error

        self.validate()
        transport = AioPikaTransport(
            self.topology(),
            self.broker_url,
            connection_name=self.connection_name or default_connection_name(self.consumer_name),
            prefetch=self.effective_prefetch,
            stop=stop,
            metrics=metrics,
            startup_timeout=self.startup_timeout,
            reconnect_interval=min(self.reconnect_interval, self.reconnect_backoff_max),
        )
        return transport.start()
