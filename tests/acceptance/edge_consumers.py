"""Consumers for ``test_cli_edges.py`` (the real ``mqdedup`` command as a subprocess).

Brokers are addressed by ``EDGE_*`` environment variables; the unreachable-broker
consumers wait ``EDGE_TIMEOUT`` seconds (default 2) so the tests stay fast.
"""

from __future__ import annotations

import os
from typing import Any

from mqdedup import Consumer, Context, Message
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer

_TIMEOUT = float(os.environ.get("EDGE_TIMEOUT", "2"))


class Plain(Consumer):
    """A database consumer with no broker (enough to reach the supervisor)."""

    name = "edge-plain"

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


class NeedsArguments(Consumer):
    """A consumer whose ``__init__`` takes a required argument."""

    name = "edge-needs-arguments"

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


class KafkaNeedsArguments(KafkaConsumer):
    """A Kafka consumer whose ``__init__`` takes a required argument (for ``replay``)."""

    topics = ("edge-never-read",)
    group_id = "edge-never-read"

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


class Rabbit(RabbitMQConsumer):
    """A RabbitMQ consumer at ``EDGE_RABBITMQ_URL`` that waits ``EDGE_TIMEOUT`` at start."""

    queue = "edge-queue"
    url = os.environ.get("EDGE_RABBITMQ_URL", "amqp://g:pw@127.0.0.1:1/%2F")
    startup_timeout = _TIMEOUT

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


class Kafka(KafkaConsumer):
    """A Kafka consumer at ``EDGE_KAFKA_BOOTSTRAP`` that waits ``EDGE_TIMEOUT`` at start."""

    topics = ("edge-topic",)
    group_id = "edge-group"
    bootstrap_servers = os.environ.get("EDGE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    connect_timeout = _TIMEOUT

    def handle(self, message: Message, ctx: Context) -> Any:
        return None
