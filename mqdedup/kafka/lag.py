"""A Kafka consumer group's lag, read without joining the group (``mqdedup status``)."""

from __future__ import annotations

from typing import Any

from mqdedup.errors import BrokerUnavailableError
from mqdedup.kafka.settings import KafkaSettings


def group_lag(settings: KafkaSettings) -> dict[str, int]:
    """``topic/partition -> end offset - committed offset`` for the consumer's topics.

    A partition without a committed offset counts from its beginning.
    """
    import kafka
    import kafka.errors
    from kafka.structs import TopicPartition

    config: dict[str, Any] = {
        key: value
        for key, value in settings.consumer_config.items()
        if key in kafka.KafkaConsumer.DEFAULT_CONFIG
    }
    config["enable_auto_commit"] = False
    try:
        client = kafka.KafkaConsumer(**config)  # never subscribes: does not join the group
    except kafka.errors.KafkaError as error:
        raise BrokerUnavailableError(f"cannot reach Kafka: {type(error).__name__}") from error
    try:
        partitions = [
            TopicPartition(topic, partition)
            for topic in settings.topics
            for partition in sorted(client.partitions_for_topic(topic) or ())
        ]
        if not partitions:
            return {}
        ends = client.end_offsets(partitions)
        starts = client.beginning_offsets(partitions)
        lag: dict[str, int] = {}
        for tp in partitions:
            committed = client.committed(tp)
            position = starts[tp] if committed is None else committed
            lag[f"{tp.topic}/{tp.partition}"] = max(0, ends[tp] - position)
        return lag
    finally:
        client.close()
