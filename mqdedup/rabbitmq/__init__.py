"""The RabbitMQ adapter (pika): consumers (sync and async, on one transport), transport,
topology, replay, publisher.

This package is the only importer of pika in mqdedup.
"""

# -- the rabbitmq extra (typed43): an ImportError naming it; keep this block first ---
from mqdedup.extras import require as _require

_require("mqdedup.rabbitmq", "pika")
# isort: split
# ruff: noqa: E402 - the imports below come after the extra is checked

from mqdedup.rabbitmq.async_consumer import AsyncRabbitMQConsumer
from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.publisher import RabbitMQPublisher
from mqdedup.rabbitmq.replies import ReplyPublisher, RequestReplyConsumer
from mqdedup.rabbitmq.topology import Binding, Topology

__all__ = [
    "AsyncRabbitMQConsumer",
    "Binding",
    "RabbitMQConsumer",
    "RabbitMQPublisher",
    "ReplyPublisher",
    "RequestReplyConsumer",
    "Topology",
]
