"""Consumers that ``mqdedup worker`` runs in the PgBouncer and failover tests.

``mqdedup worker tests.integration.postgres_ha.consumers:<Class>`` runs them in fresh
processes; the test's names travel as ``HA_*`` environment variables (prefix, topic,
group, queue, pause after each commit, an outbox topic). One business row per message in
``<prefix>orders``, which has no unique constraint: only mqdedup's claims keep a
message's effect single.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.integration.kafka.consumers import TestOrders, kill_group
from tests.support import orders_table

_PREFIX = os.environ.get("HA_PREFIX", "ha_")
#: Seconds per 100 messages after each commit, so that a kill lands mid-run on a fast
#: machine (per message: careful mode commits redelivered messages one at a time).
_PAUSE = float(os.environ.get("HA_PAUSE", "0"))
#: When set, each message also writes one outbox row to this Kafka topic (for the relay).
_OUTBOX_TOPIC = os.environ.get("HA_OUTBOX_TOPIC", "")


def _pause(messages: Sequence[Message]) -> None:
    if _PAUSE:
        time.sleep(_PAUSE * len(messages) / 100)


class KafkaOrders(TestOrders):
    """Kafka: one business row per message."""

    __test__ = False
    topics = (os.environ.get("HA_TOPIC", "ha-orders"),)
    group_id = os.environ.get("HA_GROUP", "ha-group")
    table_prefix = _PREFIX
    business_prefix = _PREFIX
    batch_size = 100
    poll_timeout = 0.2
    kafka_config = kill_group()
    metrics_interval = 1.0

    def handle(self, message: Message, ctx: Context) -> Any:
        super().handle(message, ctx)
        if _OUTBOX_TOPIC:
            ctx.outbox.publish({"id": message.id}, topic=_OUTBOX_TOPIC, key=message.id)
        return None

    def after_commit(self, messages: Sequence[Message]) -> None:
        _pause(messages)


class RabbitOrders(RabbitMQConsumer):
    """RabbitMQ: the same handler."""

    __test__ = False
    queue = os.environ.get("HA_QUEUE", "ha-orders")
    table_prefix = _PREFIX
    batch_size = 100
    poll_timeout = 0.2
    metrics_interval = 1.0

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(
            insert(orders_table(_PREFIX)).values(message_id=message.id, body=message.text()[:255])
        )
        return None

    def after_commit(self, messages: Sequence[Message]) -> None:
        _pause(messages)
