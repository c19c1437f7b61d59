"""The Kafka adapter (kafka-python): consumer, transport, offsets, replay, lag, publisher.

This package is the only importer of kafka-python in mqdedup.
"""

from mqdedup.kafka.consumer import KafkaConsumer
from mqdedup.kafka.publisher import KafkaPublisher
from mqdedup.kafka.settings import KafkaSettings

__all__ = ["KafkaConsumer", "KafkaPublisher", "KafkaSettings"]
