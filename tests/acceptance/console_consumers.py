"""Consumers for the console's browser tests, configured by environment variables.

``mqdedup console tests.acceptance.console_consumers:KafkaOrders ...`` runs in its own
process, so the test's topic, group, queue and table prefix travel as ``CONSOLE_*``
variables. While ``CONSOLE_BROKEN=1`` the handlers raise :class:`MessageError` (a bad
message, dead-lettered at once); the console runs without it, so a replay succeeds.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.errors import MessageError
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.integration.kafka.consumers import FAST_GROUP
from tests.support import orders_table

PREFIX = os.environ.get("CONSOLE_PREFIX", "console_")
BROKEN_ENV = "CONSOLE_BROKEN"


def handle_order(message: Message, ctx: Context) -> None:
    """One business row per message (no unique index: only the claims prevent doubles)."""
    if os.environ.get(BROKEN_ENV) == "1":
        if b"<script>" in message.body:
            raise MessageError("the order's note holds markup")
        raise MessageError("downstream rejected the order")
    ctx.session.execute(
        insert(orders_table(PREFIX)).values(message_id=message.id, body=message.text()[:255])
    )


class KafkaOrders(KafkaConsumer):
    """The Kafka consumer of the browser tests."""

    __test__ = False
    topics = (os.environ.get("CONSOLE_TOPIC", "console-orders"),)
    group_id = os.environ.get("CONSOLE_GROUP", "console-group")
    table_prefix = PREFIX
    batch_size = 200
    poll_timeout = 0.2
    kafka_config: ClassVar[dict[str, Any]] = dict(FAST_GROUP)
    retry_policy = RetryPolicy(max_attempts=1)

    def handle(self, message: Message, ctx: Context) -> Any:
        handle_order(message, ctx)


class RabbitOrders(RabbitMQConsumer):
    """The RabbitMQ consumer of the browser tests."""

    __test__ = False
    queue = os.environ.get("CONSOLE_QUEUE", "console-orders")
    table_prefix = PREFIX
    batch_size = 100
    retry_policy = RetryPolicy(max_attempts=1)

    def handle(self, message: Message, ctx: Context) -> Any:
        handle_order(message, ctx)
