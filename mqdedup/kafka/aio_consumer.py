"""Async Kafka consumers (aiokafka): subclass :class:`AsyncKafkaConsumer`, ``async def handle``.

::

    class Orders(AsyncKafkaConsumer):
        topics = ["orders"]
        group_id = "billing"

        async def handle(self, message, ctx):
            await ctx.session.execute(insert(invoices).values(...))

The class attributes are those of :class:`~mqdedup.kafka.consumer.KafkaConsumer`
(topics / topic_pattern, group_id, bootstrap_servers, batch_size, dead_letter_topic,
commit_interval, prefetch_batches, ...). ``kafka_config`` keys that aiokafka's consumer
also takes (``session_timeout_ms``, ``max_poll_interval_ms``, ``security_protocol``,
``sasl_*``, ...) are passed to it; ``aiokafka_config`` holds aiokafka-only settings
(``ssl_context``, ...). The transport is :class:`~mqdedup.kafka.aio_transport.AioKafkaTransport`,
run inside the greenlet bridge on the event loop (see ``docs/asyncio.md``). aiokafka is
imported only when a transport is created or the settings are checked (the ``asyncio``
extra), so ``import mqdedup.kafka`` works without it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from mqdedup.consumers.async_consumer import AsyncConsumer
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError
from mqdedup.kafka.aio_settings import AioKafkaSettings
from mqdedup.kafka.consumer import KafkaConsumer
from mqdedup.kafka.membership import GROUP_DEFAULTS
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.kafka.aio_transport import AioKafkaTransport

# aiokafka settings mqdedup sets itself, and why a user may not.
_RESERVED = {
    "enable_auto_commit": "mqdedup commits offsets itself, after the database commit",
    "group_id": "set the group_id class attribute instead",
    "bootstrap_servers": "set the bootstrap_servers class attribute or $MQDEDUP_KAFKA_BOOTSTRAP",
    "key_deserializer": "handlers receive the raw bytes (decode them in handle())",
    "value_deserializer": "handlers receive the raw bytes (decode them in handle())",
    "loop": "the transport runs on the running event loop",
}
# Connection settings shared by the consumer, the dead-letter producer and the admin client.
_SHARED_KEYS = frozenset(
    {
        "security_protocol",
        "ssl_context",
        "api_version",
        "connections_max_idle_ms",
        "request_timeout_ms",
        "retry_backoff_ms",
        "metadata_max_age_ms",
    }
)


class AsyncKafkaConsumer(AsyncConsumer, KafkaConsumer):
    """A Kafka consumer run on an asyncio event loop through aiokafka (see the module docs).

    ``async def handle`` / ``handle_batch`` get a guarded ``AsyncSession``
    (:class:`~mqdedup.consumers.async_consumer.AsyncConsumer`); ``run`` (what
    ``mqdedup worker`` calls) runs an event loop of its own, ``await run_async(...)``
    runs on yours.
    """

    #: aiokafka-only ``AIOKafkaConsumer`` settings (e.g. ``ssl_context``); applied last.
    aiokafka_config: ClassVar[Mapping[str, Any]] = {}

    def validate(self) -> None:
        """Check the class attributes (also ``aiokafka_config``); raise ConfigurationError."""
        super().validate()
        label = type(self).__name__
        known = _parameters("consumer")
        unknown = sorted(set(self.aiokafka_config) - known)
        if unknown:
            raise ConfigurationError(
                f"{label}.aiokafka_config has unknown aiokafka consumer setting(s): "
                f"{', '.join(unknown)}"
            )
        for key, why in _RESERVED.items():
            if key in self.aiokafka_config:
                raise ConfigurationError(f"{label}.aiokafka_config must not set {key}: {why}")

    def aiokafka_settings(self) -> AioKafkaSettings:
        """Validate and resolve the keyword arguments of the aiokafka clients."""
        base = self.kafka_settings()  # validates
        cls = type(self)
        consumer: dict[str, Any] = {
            "bootstrap_servers": list(base.bootstrap_servers),
            "client_id": f"mqdedup-{self.consumer_name}",
            "group_id": base.group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": cls.auto_offset_reset,
            "max_poll_records": max(cls.batch_size, 1),
            "metadata_max_age_ms": int(cls.metadata_refresh * 1000),
            **GROUP_DEFAULTS,
        }
        instance_id = self.group_instance_id(base.group_id)
        if instance_id is not None:
            consumer["group_instance_id"] = instance_id
        consumer_keys = _parameters("consumer")
        consumer.update({k: v for k, v in cls.kafka_config.items() if k in consumer_keys})
        consumer.update(cls.aiokafka_config)
        shared = {k: v for k, v in consumer.items() if k in _SHARED_KEYS or k.startswith("sasl_")}
        producer_keys = _parameters("producer")
        producer: dict[str, Any] = {
            "bootstrap_servers": list(base.bootstrap_servers),
            "client_id": f"mqdedup-{self.consumer_name}-dead-letter",
            **{k: v for k, v in shared.items() if k in producer_keys},
            "acks": "all",
            "enable_idempotence": True,
        }
        admin_keys = _parameters("admin")
        admin: dict[str, Any] = {
            "bootstrap_servers": list(base.bootstrap_servers),
            "client_id": f"mqdedup-{self.consumer_name}-admin",
            **{k: v for k, v in shared.items() if k in admin_keys},
        }
        return AioKafkaSettings(
            base=base,
            consumer=consumer,
            producer=producer,
            admin=admin,
            connect_timeout=cls.connect_timeout,
        )

    def create_transport(  # type: ignore[override]
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> AioKafkaTransport:
        """Join the consumer group through aiokafka: a started transport (inside the bridge).

        ``stop``: when requested, the transport hands out nothing more while the batch in
        flight is still settled; ``metrics``: where it reports the partitions' lag.
        """
        from mqdedup.kafka.aio_transport import AioKafkaTransport  # the asyncio extra

        settings = self.aiokafka_settings()
        return AioKafkaTransport(settings, stop=stop, metrics=metrics).start()


def _parameters(client: str) -> set[str]:
    """The keyword arguments aiokafka's ``consumer`` / ``producer`` / ``admin`` client takes."""
    try:  # the asyncio extra
        import aiokafka  # type: ignore[import-untyped]
        from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]
    except ImportError as error:
        raise ConfigurationError(
            "async Kafka consumers need aiokafka: pip install 'mqdedup[asyncio]'"
        ) from error
    target = {
        "consumer": aiokafka.AIOKafkaConsumer,
        "producer": aiokafka.AIOKafkaProducer,
        "admin": AIOKafkaAdminClient,
    }[client]
    return {
        name
        for name, parameter in inspect.signature(target.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        or parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    } - {"self"}
