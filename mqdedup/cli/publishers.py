"""The publishers of ``mqdedup relay``: the standard Kafka / RabbitMQ ones, built at the edge.

The relay (:class:`mqdedup.outbox.relay.Relay`) takes its publishers as an argument and
never imports a broker adapter; this module is where the command line picks them.
"""

from __future__ import annotations

import os

from mqdedup.errors import ConfigurationError
from mqdedup.outbox.publishers import Publisher


def create_publishers(
    *, kafka_bootstrap: str | None = None, rabbitmq_url: str | None = None
) -> dict[str, Publisher]:
    """The standard publishers for the given brokers (``MQDEDUP_KAFKA_BOOTSTRAP`` and
    ``MQDEDUP_RABBITMQ_URL`` when not given); at least one must be configured."""
    kafka_bootstrap = kafka_bootstrap or os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    rabbitmq_url = rabbitmq_url or os.environ.get("MQDEDUP_RABBITMQ_URL")
    publishers: dict[str, Publisher] = {}
    if kafka_bootstrap:
        from mqdedup.kafka.publisher import KafkaPublisher  # lazy: the kafka extra

        publishers["kafka"] = KafkaPublisher(kafka_bootstrap)
    if rabbitmq_url:
        from mqdedup.rabbitmq.publisher import RabbitMQPublisher  # lazy: the rabbitmq extra

        publishers["rabbitmq"] = RabbitMQPublisher(rabbitmq_url)
    if not publishers:
        raise ConfigurationError(
            "no broker configured for the relay: set MQDEDUP_KAFKA_BOOTSTRAP and/or "
            "MQDEDUP_RABBITMQ_URL"
        )
    return publishers
