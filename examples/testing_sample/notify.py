"""Two order consumers that record each order and send an ``order-accepted`` notification.

* :class:`OrderNotifier` (Kafka) / :class:`RabbitOrderNotifier` (RabbitMQ) write the
  notification with ``ctx.outbox``: it commits with the order row, the relay publishes
  it after commit, always with the same message id. Effectively once.
* :class:`DirectOrderNotifier` / :class:`DirectRabbitOrderNotifier` publish the
  notification **straight to the broker from inside** ``handle``, with a fresh message
  id, as hand-written code often does. The order row is still deduplicated, but every
  time the handler runs again (the transaction rolled back after a crash in the middle
  of a batch, a batch-mate failed, the database went away before commit) another
  notification with another id goes out: the next consumer cannot recognise it as a
  duplicate, and the customer gets two e-mails. The test kit catches exactly that.

Tables are named after the consumer's ``table_prefix``, so the test kit's per-test
prefix isolates them too (``orders_table(prefix)``).
"""

from __future__ import annotations

import json
import uuid
from functools import cache
from typing import Any, ClassVar

from sqlalchemy import Column, Integer, MetaData, String, Table, insert

from mqdedup import Context, Message
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer


@cache
def orders_table(prefix: str) -> Table:
    """The business table: one row per applied order (no unique constraint on purpose)."""
    return Table(
        f"{prefix}sample_orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("order_no", Integer, nullable=False),
    )


def record_order(consumer: Any, message: Message, ctx: Context) -> dict[str, Any]:
    """Insert the order row; return the notification to send."""
    order = message.json()
    ctx.session.execute(
        insert(orders_table(consumer.table_prefix)).values(
            message_id=message.id, order_no=int(order["order"])
        )
    )
    return {"order": order["order"], "status": "accepted"}


class OrderNotifier(KafkaConsumer):
    """Correct: the notification is an outbox row of the order's transaction."""

    topics: ClassVar[list[str]] = ["orders"]
    group_id: ClassVar[str | None] = "order-notifier"
    batch_size: ClassVar[int] = 10
    #: Where notifications go (the test sets a fresh topic).
    notifications_topic: ClassVar[str] = "order-notifications"

    def handle(self, message: Message, ctx: Context) -> None:
        """Record the order; the relay sends the notification after commit."""
        notification = record_order(self, message, ctx)
        ctx.outbox.publish(
            notification, topic=self.notifications_topic, key=str(notification["order"])
        )


class DirectOrderNotifier(OrderNotifier):
    """NOT idempotent: publishes the notification to Kafka from inside the handler."""

    _producer: ClassVar[Any] = None

    def handle(self, message: Message, ctx: Context) -> None:
        """Record the order and send the notification right away (the bug)."""
        notification = record_order(self, message, ctx)
        headers = {"message-id": str(uuid.uuid4()), "causation-id": str(message.id)}
        self.send(self.notifications_topic, json.dumps(notification).encode(), headers)

    def send(self, topic: str, body: bytes, headers: dict[str, str]) -> None:
        """Publish and wait for the broker's acknowledgement."""
        import kafka

        if DirectOrderNotifier._producer is None:
            DirectOrderNotifier._producer = kafka.KafkaProducer(
                bootstrap_servers=self.bootstrap_servers, acks="all"
            )
        pairs = [(name, value.encode()) for name, value in headers.items()]
        DirectOrderNotifier._producer.send(topic, value=body, headers=pairs).get(timeout=30)


class RabbitOrderNotifier(RabbitMQConsumer):
    """Correct, on RabbitMQ: the notification goes to a queue through the outbox."""

    queue: ClassVar[str] = "orders"
    batch_size: ClassVar[int] = 10
    #: Where notifications go (default exchange: the routing key is the queue).
    notifications_queue: ClassVar[str] = "order-notifications"

    def handle(self, message: Message, ctx: Context) -> None:
        """Record the order; the relay sends the notification after commit."""
        notification = record_order(self, message, ctx)
        ctx.outbox.publish(
            notification,
            exchange="",
            routing_key=self.notifications_queue,
            key=str(notification["order"]),
        )


class DirectRabbitOrderNotifier(RabbitOrderNotifier):
    """NOT idempotent: publishes the notification to RabbitMQ from inside the handler."""

    _channel: ClassVar[Any] = None

    def handle(self, message: Message, ctx: Context) -> None:
        """Record the order and send the notification right away (the bug)."""
        notification = record_order(self, message, ctx)
        self.send(
            self.notifications_queue,
            json.dumps(notification).encode(),
            {"causation-id": str(message.id)},
            message_id=str(uuid.uuid4()),
        )

    def send(self, queue: str, body: bytes, headers: dict[str, str], *, message_id: str) -> None:
        """Publish with a broker confirm."""
        import pika

        if DirectRabbitOrderNotifier._channel is None:
            connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
            channel = connection.channel()
            channel.confirm_delivery()
            DirectRabbitOrderNotifier._channel = channel
        properties = pika.BasicProperties(message_id=message_id, headers=headers, delivery_mode=2)
        DirectRabbitOrderNotifier._channel.basic_publish("", queue, body, properties)
