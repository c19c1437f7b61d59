"""Consumers with ``dedup = RedisDedup(...)`` for ``mqdedup worker``, set by ``ACCEPT_*``.

Their effect is an entry in the Redis list ``<ACCEPT_NAMESPACE>effects``: a handler with
no database write at all (think: sending an SMS). The same handler reads from RabbitMQ
(:class:`SendSms`) or Kafka (:class:`SendSmsFromKafka`): the claim store is a consumer
attribute, the broker is the consumer's class.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import redis

from mqdedup import Context, Message, RedisDedup
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer

_NAMESPACE = os.environ.get("ACCEPT_NAMESPACE", "accept:sms:")
_DELAY = float(os.environ.get("ACCEPT_DELAY", "0"))  # seconds per "SMS provider call"


class _Sender:
    """Sends one "SMS" (an entry in a Redis list) per unique request."""

    dedup = RedisDedup(namespace=_NAMESPACE, lease=3.0)
    batch_size = 50
    poll_timeout = 0.2

    def __init__(self) -> None:
        self.effects = redis.Redis.from_url(os.environ["MQDEDUP_REDIS_URL"])

    def handle(self, message: Message, ctx: Context) -> Any:
        if _DELAY:
            time.sleep(_DELAY)
        self.effects.rpush(f"{_NAMESPACE}effects", str(message.id))
        return {"sent": message.id}


class SendSms(_Sender, RabbitMQConsumer):
    """SMS requests from a RabbitMQ queue (``ACCEPT_QUEUE``)."""

    name = "accept-sms"
    queue = os.environ.get("ACCEPT_QUEUE", "accept-sms")
    prefetch = 100


class SendSmsFromKafka(_Sender, KafkaConsumer):
    """SMS requests on a Kafka topic (``ACCEPT_TOPIC``, group ``ACCEPT_GROUP``)."""

    name = "accept-sms-kafka"
    topics = (os.environ.get("ACCEPT_TOPIC", "accept-sms"),)
    group_id = os.environ.get("ACCEPT_GROUP", "accept-sms")
    kafka_config: ClassVar[dict[str, Any]] = {
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
    }


class BadRedisUrl(SendSms):
    """A Redis URL that is not one: the worker must refuse it in one line."""

    dedup = RedisDedup(url="http://127.0.0.1:6379/0")
