"""Async consumers (``async def handle`` with an ``AsyncSession``) for the CLI tests.

``AsyncKafkaConsumer`` / ``AsyncRabbitMQConsumer``: the Kafka / RabbitMQ transports of
the synchronous consumers, driven from one event loop per worker process (the pipeline
inside the bridge, the transport's blocking calls in a thread). The test's names travel as
``ASYNC_*`` environment variables (``mqdedup worker`` imports these classes afresh).
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import insert

from mqdedup import AsyncConsumer, AsyncContext, Message
from mqdedup.kafka import AsyncKafkaConsumer
from mqdedup.rabbitmq import AsyncRabbitMQConsumer
from tests.integration.kafka.consumers import FAST_GROUP
from tests.support import orders_table


async def write_order(consumer: AsyncConsumer, message: Message, ctx: AsyncContext) -> Any:
    """One order row and one outgoing event, awaited through the async session."""
    table = orders_table(consumer.table_prefix)
    await ctx.session.execute(
        insert(table).values(message_id=message.id, body=message.text()[:255])
    )
    await ctx.outbox.publish({"order": message.id}, topic="order-events", key=message.id)
    return {"stored": message.id}


class AsyncKafkaOrders(AsyncKafkaConsumer):
    """Kafka, async handler."""

    __test__ = False
    topics = (os.environ.get("ASYNC_TOPIC", "async-orders"),)
    group_id = os.environ.get("ASYNC_GROUP", "async-orders")
    table_prefix = os.environ.get("ASYNC_PREFIX", "async_")
    batch_size = 25
    poll_timeout = 0.2
    kafka_config = FAST_GROUP
    metrics_interval = 5.0

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        return await write_order(self, message, ctx)


class AsyncRabbitOrders(AsyncRabbitMQConsumer):
    """RabbitMQ, async handler."""

    __test__ = False
    queue = os.environ.get("ASYNC_QUEUE", "async-orders")
    table_prefix = os.environ.get("ASYNC_PREFIX", "async_")
    batch_size = 10
    poll_timeout = 0.2

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        return await write_order(self, message, ctx)
