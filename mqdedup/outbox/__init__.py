"""The transactional outbox: rows written in the business transaction, published later.

* :class:`OutboxWriter` (``ctx.outbox`` in handlers) adds outgoing messages to the
  caller's transaction;
* :class:`Relay` publishes committed rows through publishers
  (:class:`~mqdedup.kafka.publisher.KafkaPublisher`,
  :class:`~mqdedup.rabbitmq.publisher.RabbitMQPublisher`, or
  :class:`MemoryPublisher` in tests), at least once, with stable message ids;
* :class:`OutboxStore` has the operator's tools: status, retry of failed rows, purge.

The Kafka and RabbitMQ publishers live in the adapter packages (``mqdedup.kafka``,
``mqdedup.rabbitmq``): this package never imports them, nor ``kafka`` or ``pika``.
"""

from mqdedup.outbox.async_writer import AsyncOutboxWriter
from mqdedup.outbox.memory import MemoryPublisher
from mqdedup.outbox.publishers import OutboxRecord, Publisher, PublishOutcome, PublishResult
from mqdedup.outbox.relay import Relay, RelayConfig, RelayMetrics
from mqdedup.outbox.store import DestinationStatus, OutboxStatus, OutboxStore
from mqdedup.outbox.writer import (
    InvalidOutgoingMessageError,
    OutboxWriter,
    OutgoingMessage,
    outgoing_message_id,
)

__all__ = [
    "AsyncOutboxWriter",
    "DestinationStatus",
    "InvalidOutgoingMessageError",
    "MemoryPublisher",
    "OutboxRecord",
    "OutboxStatus",
    "OutboxStore",
    "OutboxWriter",
    "OutgoingMessage",
    "PublishOutcome",
    "PublishResult",
    "Publisher",
    "Relay",
    "RelayConfig",
    "RelayMetrics",
    "outgoing_message_id",
]
