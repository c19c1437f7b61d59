"""Consumers for the CLI acceptance tests, configured by environment variables.

``mqdedup worker tests.acceptance.cli_consumers:Orders`` runs in fresh processes, so the
test's topic, group and table prefix travel as ``ACCEPT_*`` variables.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message
from mqdedup.errors import MessageError
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.integration.kafka.consumers import BulkTestOrders, TestOrders, kill_group
from tests.support import orders_table

_PREFIX = os.environ.get("ACCEPT_PREFIX", "accept_")


class Orders(BulkTestOrders):
    """One business row per message (bulk insert), in ``<ACCEPT_PREFIX>orders``."""

    __test__ = False
    topics = (os.environ.get("ACCEPT_TOPIC", "accept-orders"),)
    group_id = os.environ.get("ACCEPT_GROUP", "accept-group")
    table_prefix = _PREFIX
    business_prefix = _PREFIX
    batch_size = 200
    poll_timeout = 0.2
    kafka_config = kill_group()
    metrics_interval = 5.0


class NotAConsumer:
    """A class that is not a mqdedup consumer."""


class StreamOrders(RabbitMQConsumer):
    """Reads the ``ACCEPT_STREAM`` stream queue; one business row per message."""

    __test__ = False
    queue = os.environ.get("ACCEPT_STREAM", "accept-stream")
    table_prefix = _PREFIX
    batch_size = 100

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(
            insert(orders_table(_PREFIX)).values(message_id=message.id, body=message.text()[:255])
        )


class DeadLetterOrders(TestOrders):
    """:class:`Orders`, one message at a time; the ids in ``ACCEPT_FAIL`` (comma-separated,
    read at each message) raise :class:`MessageError`: dead-lettered at once."""

    __test__ = False
    topics = Orders.topics
    group_id = Orders.group_id
    table_prefix = _PREFIX
    business_prefix = _PREFIX
    batch_size = 50
    poll_timeout = 0.2
    kafka_config = kill_group()
    metrics_interval = 5.0

    def handle(self, message: Message, ctx: Context) -> Any:
        failing = set(filter(None, os.environ.get("ACCEPT_FAIL", "").split(",")))
        if message.id in failing:
            raise MessageError(f"bad order {message.id}")
        return super().handle(message, ctx)
