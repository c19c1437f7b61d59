"""The RabbitMQ adapter (pika): consumer, transport, topology, replay, publisher.

This package is the only importer of pika in mqdedup.
"""

from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.publisher import RabbitMQPublisher
from mqdedup.rabbitmq.replies import ReplyPublisher, RequestReplyConsumer
from mqdedup.rabbitmq.topology import Binding, Topology

__all__ = [
    "Binding",
    "RabbitMQConsumer",
    "RabbitMQPublisher",
    "ReplyPublisher",
    "RequestReplyConsumer",
    "Topology",
]
