"""A RedisConsumer for ``mqdedup worker``, configured by ``ACCEPT_*`` variables.

Its effect is an entry in the Redis list ``<ACCEPT_NAMESPACE>effects``: a handler with no
database write at all (think: sending an SMS).
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import redis

from mqdedup import Message
from mqdedup.dedup.redis_store import RedisConsumer, RedisContext
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer

_NAMESPACE = os.environ.get("ACCEPT_NAMESPACE", "accept:sms:")
_DELAY = float(os.environ.get("ACCEPT_DELAY", "0"))  # seconds per "SMS provider call"


class SmsRequests(RabbitMQConsumer):
    """Where the SMS requests come from (the queue); it handles nothing itself."""

    queue = os.environ.get("ACCEPT_QUEUE", "accept-sms")
    prefetch = 100


class SendSms(RedisConsumer):
    """Sends one "SMS" (an entry in a Redis list) per unique request."""

    name = "accept-sms"
    source = SmsRequests
    namespace = _NAMESPACE
    batch_size = 50
    poll_timeout = 0.2
    lease = 3.0

    def __init__(self) -> None:
        self.effects = redis.Redis.from_url(os.environ["MQDEDUP_REDIS_URL"])

    def handle(self, message: Message, ctx: RedisContext) -> Any:
        if _DELAY:
            time.sleep(_DELAY)
        self.effects.rpush(f"{_NAMESPACE}effects", str(message.id))
        return {"sent": message.id}


class SmsTopic(KafkaConsumer):
    """SMS requests on a Kafka topic (``ACCEPT_TOPIC``, group ``ACCEPT_GROUP``)."""

    topics = (os.environ.get("ACCEPT_TOPIC", "accept-sms"),)
    group_id = os.environ.get("ACCEPT_GROUP", "accept-sms")
    kafka_config: ClassVar[dict[str, Any]] = {
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
    }


class SendSmsFromKafka(SendSms):
    """The same sender, reading from Kafka instead of RabbitMQ."""

    name = "accept-sms-kafka"
    source = SmsTopic


class NoSource(RedisConsumer):
    """A RedisConsumer that names no source: the worker must refuse it in one line."""

    def handle(self, message: Message, ctx: RedisContext) -> Any:
        return None
