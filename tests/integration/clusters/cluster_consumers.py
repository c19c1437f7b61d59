"""Consumers that the cluster tests run with ``mqdedup worker`` (configured by env vars).

``MQDEDUP_TEST_CLUSTER_TARGET`` names the topic (Kafka) or the quorum queue (RabbitMQ),
``MQDEDUP_TEST_CLUSTER_GROUP`` the Kafka group, ``MQDEDUP_TEST_CLUSTER_PREFIX`` the
business table's prefix (``<prefix>orders``, :func:`tests.support.orders_table`) and
``MQDEDUP_TEST_CLUSTER_DELAY`` a pause after each committed batch (so a kill finds the
run in the middle). The broker address comes from the CLI (``--kafka-bootstrap``,
``--rabbitmq-url`` with the cluster's node URLs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from sqlalchemy import insert

from mqdedup import Context, Message
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.support import orders_table

TARGET = os.environ.get("MQDEDUP_TEST_CLUSTER_TARGET", "unset")
PREFIX = os.environ.get("MQDEDUP_TEST_CLUSTER_PREFIX", "")
DELAY = float(os.environ.get("MQDEDUP_TEST_CLUSTER_DELAY", "0"))


def _write(message: Message, ctx: Context) -> None:
    ctx.session.execute(
        insert(orders_table(PREFIX)).values(
            message_id=message.id,
            body=message.body.decode("utf-8", "replace")[:255],
            worker=str(os.getpid()),
        )
    )


class ClusterKafkaOrders(KafkaConsumer):
    """One ``<prefix>orders`` row per message of the RF=3 topic."""

    topics = (TARGET,)
    group_id = os.environ.get("MQDEDUP_TEST_CLUSTER_GROUP", "unset")
    batch_size = 20
    kafka_config: ClassVar[dict[str, Any]] = {
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
    }

    def handle(self, message: Message, ctx: Context) -> None:
        _write(message, ctx)

    def after_commit(self, messages: Sequence[Message]) -> None:
        if DELAY:
            time.sleep(DELAY)


class ClusterRabbitOrders(RabbitMQConsumer):
    """One ``<prefix>orders`` row per message of the quorum queue."""

    queue = TARGET
    queue_type = "quorum"
    queue_arguments: ClassVar[dict[str, Any]] = {"x-delivery-limit": 20}
    batch_size = 20
    startup_timeout = 60.0
    reconnect_backoff_max = 2.0

    def handle(self, message: Message, ctx: Context) -> None:
        _write(message, ctx)

    def after_commit(self, messages: Sequence[Message]) -> None:
        if DELAY:
            time.sleep(DELAY)
