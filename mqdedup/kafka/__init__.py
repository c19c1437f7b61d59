"""The Kafka adapter (kafka-python): consumers (sync and async, on one transport),
transport, offsets, replay, lag, publisher.

This package is the only importer of kafka-python in mqdedup.
"""

from mqdedup.kafka.async_consumer import AsyncKafkaConsumer
from mqdedup.kafka.consumer import KafkaConsumer
from mqdedup.kafka.publisher import KafkaPublisher
from mqdedup.kafka.settings import KafkaSettings

__all__ = ["AsyncKafkaConsumer", "KafkaConsumer", "KafkaPublisher", "KafkaSettings"]
