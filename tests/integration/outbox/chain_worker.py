"""A consumer process of the chain tests: ``python -m tests.integration.outbox.chain_worker``.

One JSON argument with ``role``:

* ``forwarder``: a :class:`KafkaConsumer` of ``topic`` (group ``group``) that writes an
  ``events`` row (consumer ``A``) and publishes the body through the outbox to the
  RabbitMQ default exchange with routing key ``queue``;
* ``receiver``: a :class:`RabbitMQConsumer` of ``queue`` that writes an ``events`` row
  (consumer ``B``).

Both use the test's table ``prefix`` and ``database_url``; they run ``consumer.run``
under graceful signal handling like ``mqdedup worker``, print ``STARTED`` first and
``METRICS <json>`` after a graceful stop.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.consumers.base import Consumer
from mqdedup.db import create_engine
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals
from tests.integration.outbox.helpers import events_table

FAST_GROUP = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.2)


def build(config: dict[str, Any]) -> Consumer:
    events = events_table(config["prefix"])
    if config["role"] == "forwarder":
        group_settings = {**FAST_GROUP, **config.get("kafka_config", {})}

        class Forwarder(KafkaConsumer):
            topics = (config["topic"],)
            group_id = config["group"]
            bootstrap_servers = config["kafka"]
            table_prefix = config["prefix"]
            batch_size = int(config.get("batch_size", 50))
            poll_timeout = 0.2
            kafka_config = group_settings
            retry_policy = RETRY

            def handle(self, message: Message, ctx: Context) -> Any:
                ctx.session.execute(
                    insert(events).values(consumer="A", message_id=message.id, body=message.text())
                )
                ctx.outbox.publish(message.body, exchange="", routing_key=config["queue"])
                return None

        return Forwarder()

    class Receiver(RabbitMQConsumer):
        queue = config["queue"]
        url = config["rabbitmq"]
        table_prefix = config["prefix"]
        batch_size = int(config.get("batch_size", 50))
        poll_timeout = 0.2
        retry_policy = RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(
                insert(events).values(consumer="B", message_id=message.id, body=message.text())
            )
            return None

    return Receiver()


def main() -> int:
    config: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s"
    )
    consumer = build(config)
    engine = create_engine(config["database_url"])
    stop = StopToken()
    print("STARTED", flush=True)
    try:
        with graceful_signals(stop):
            metrics = consumer.run(engine, stop=stop)
    except ImmediateStop:
        return 130
    finally:
        engine.dispose()
    print("METRICS " + json.dumps(metrics.snapshot()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
