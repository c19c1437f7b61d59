"""The RabbitMQ adapter (pika): consumer, transport, topology, replay, publisher; and the
aio-pika transport of async consumers (``AsyncRabbitMQConsumer``).

This package is the only importer of pika and aio-pika in mqdedup; aio-pika is imported
only when an async consumer creates its transport (the ``asyncio`` extra).
"""

# -- the rabbitmq extra (typed43): an ImportError naming it; keep this block first ---
from mqdedup.extras import require as _require

_require("mqdedup.rabbitmq", "pika")
# isort: split
# ruff: noqa: E402 - the imports below come after the extra is checked

from mqdedup.rabbitmq.aio_consumer import AsyncRabbitMQConsumer
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
