"""Consumers whose handler kills its process for one message id (``os._exit(1)``).

``mqdedup worker tests.acceptance.killer_consumers:<Class>`` runs them in fresh
processes; the test's names travel as ``KILLER_*`` environment variables. Every run of
the killer's handler appends a line to ``KILLER_RUNS_FILE`` before the process dies.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.integration.kafka.consumers import TestOrders, kill_group
from tests.support import orders_table

_PREFIX = os.environ.get("KILLER_PREFIX", "killer_")
_KILL_ID = os.environ.get("KILLER_ID", "m-10")
_RUNS_FILE = os.environ.get("KILLER_RUNS_FILE", "")
#: A small limit keeps the test short: the killer takes max_attempts + 1 worker lives.
MAX_ATTEMPTS = 2
_RETRY = RetryPolicy(max_attempts=MAX_ATTEMPTS, initial_backoff=0.05, max_backoff=0.2)


def _die_for_the_killer(message: Message) -> None:
    if message.id != _KILL_ID:
        return
    if _RUNS_FILE:
        with open(_RUNS_FILE, "a", encoding="utf-8") as runs:
            runs.write(f"{os.getpid()}\n")
    os._exit(1)  # the process dies at once: no exception, no cleanup, nothing recorded


class KafkaKiller(TestOrders):
    """Kafka: one business row per message; ``KILLER_ID`` kills the process."""

    __test__ = False
    topics = (os.environ.get("KILLER_TOPIC", "killer-orders"),)
    group_id = os.environ.get("KILLER_GROUP", "killer-group")
    table_prefix = _PREFIX
    business_prefix = _PREFIX
    batch_size = 50
    poll_timeout = 0.2
    kafka_config = kill_group()
    retry_policy = _RETRY
    metrics_interval = 5.0

    def handle(self, message: Message, ctx: Context) -> Any:
        _die_for_the_killer(message)
        return super().handle(message, ctx)


class RabbitKiller(RabbitMQConsumer):
    """RabbitMQ (``KILLER_QUEUE_TYPE`` classic or quorum): the same handler."""

    __test__ = False
    queue = os.environ.get("KILLER_QUEUE", "killer-orders")
    queue_type = "quorum" if os.environ.get("KILLER_QUEUE_TYPE") == "quorum" else "classic"
    table_prefix = _PREFIX
    batch_size = 50
    poll_timeout = 0.2
    retry_policy = _RETRY

    def handle(self, message: Message, ctx: Context) -> Any:
        _die_for_the_killer(message)
        ctx.session.execute(
            insert(orders_table(_PREFIX)).values(message_id=message.id, body=message.text()[:255])
        )
        return None
