"""What the aiokafka transport needs from a consumer class, resolved once.

:meth:`mqdedup.kafka.aio_consumer.AsyncKafkaConsumer.aiokafka_settings` builds it from
the same class attributes as the kafka-python consumer (:class:`KafkaSettings`) plus
``aiokafka_config``; the transport and its dead-letter producer read it from here, so
neither imports the consumer (no cycle). No aiokafka import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mqdedup.kafka.settings import KafkaSettings


@dataclass(frozen=True)
class AioKafkaSettings:
    """Everything the aiokafka transport needs (keyword arguments of its clients)."""

    #: The shared settings (topics, group, dead-letter topic, timeouts, buffer size).
    base: KafkaSettings
    #: Keyword arguments of ``aiokafka.AIOKafkaConsumer``.
    consumer: Mapping[str, Any]
    #: Keyword arguments of the dead-letter ``aiokafka.AIOKafkaProducer``.
    producer: Mapping[str, Any]
    #: Keyword arguments of ``aiokafka.admin.AIOKafkaAdminClient`` (dead-letter topics).
    admin: Mapping[str, Any]
    #: Seconds to wait for the first connection to the brokers.
    connect_timeout: float

    @property
    def consumer_name(self) -> str:
        """The dedup scope (for logs)."""
        return self.base.consumer_name
