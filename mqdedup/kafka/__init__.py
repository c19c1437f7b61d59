"""The Kafka adapter (kafka-python): consumer, transport, offsets, replay, lag, publisher;
and the aiokafka transport of async consumers (``AsyncKafkaConsumer``).

This package is the only importer of kafka-python and aiokafka in mqdedup; aiokafka is
imported only when an async consumer creates its transport (the ``asyncio`` extra).
"""

from mqdedup.kafka.aio_consumer import AsyncKafkaConsumer
from mqdedup.kafka.consumer import KafkaConsumer
from mqdedup.kafka.publisher import KafkaPublisher
from mqdedup.kafka.settings import KafkaSettings

__all__ = ["AsyncKafkaConsumer", "KafkaConsumer", "KafkaPublisher", "KafkaSettings"]
