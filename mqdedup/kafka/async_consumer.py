"""Async Kafka consumers: subclass :class:`AsyncKafkaConsumer`, ``async def handle``.

::

    class Orders(AsyncKafkaConsumer):
        topics = ["orders"]
        group_id = "billing"

        async def handle(self, message, ctx):
            await ctx.session.execute(insert(invoices).values(...))

The class attributes are those of :class:`~mqdedup.kafka.consumer.KafkaConsumer`
(topics / topic_pattern, group_id, bootstrap_servers, batch_size, dead_letter_topic,
commit_interval, prefetch_batches, ``kafka_config``, ...), and so is the transport: the
same :class:`~mqdedup.kafka.transport.KafkaTransport` (kafka-python, its own poll
thread), driven from the event loop through
:class:`~mqdedup.consumers.bridged_transport.BridgedTransport` (see ``docs/asyncio.md``).
"""

from __future__ import annotations

from mqdedup.consumers.async_consumer import AsyncConsumer
from mqdedup.consumers.bridged_transport import BridgedTransport
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError
from mqdedup.kafka.consumer import KafkaConsumer
from mqdedup.kafka.records import KafkaToken
from mqdedup.kafka.transport import KafkaTransport
from mqdedup.stopping import StopToken


class AsyncKafkaConsumer(AsyncConsumer, KafkaConsumer):
    """A Kafka consumer run on an asyncio event loop (see the module docs).

    ``async def handle`` / ``handle_batch`` get a guarded ``AsyncSession``
    (:class:`~mqdedup.consumers.async_consumer.AsyncConsumer`); ``run`` (what
    ``mqdedup worker`` calls) runs an event loop of its own, ``await run_async(...)``
    runs on yours.
    """

    def validate(self) -> None:
        """Check the class attributes; raise ConfigurationError naming the problem."""
        if getattr(type(self), "aiokafka_config", None):
            raise ConfigurationError(
                f"{type(self).__name__}.aiokafka_config is no longer read: async Kafka "
                "consumers run on kafka-python like KafkaConsumer; put these settings in "
                "kafka_config under their kafka-python names (e.g. ssl_context, sasl_*)"
            )
        super().validate()

    def create_transport(  # type: ignore[override]
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> BridgedTransport[KafkaToken]:
        """Join the consumer group: the started kafka-python transport, driven from the
        event loop (its start, fetch waits, dead letters and close run in a thread).

        ``stop``: when requested, the transport hands out nothing more while the batch in
        flight is still settled; ``metrics``: where it reports the partitions' lag.
        """
        settings = self.kafka_settings()  # validates

        def start() -> KafkaTransport:
            return KafkaTransport(settings, stop=stop, metrics=metrics).start()

        return BridgedTransport.start(start, name=f"kafka:{settings.consumer_name}")
