"""Create the payment service's tables and queue: ``python -m examples.payments.setup``.

Idempotent: mqdedup's tables (``mqdedup db init`` does the same), the payments and
ledger tables, and the queue with its dead-letter queue (declared exactly as the
consumer declares them) are created only when missing.
"""

from __future__ import annotations

import pika

from examples import settings
from examples.payments import config
from examples.payments.consumer import PaymentConsumer
from mqdedup import init_schema
from mqdedup.rabbitmq.topology import declare_dead_letter_topology, declare_topology


def declare_queues() -> str:
    """Declare the consumer's queue and dead-letter queue; return the queue name."""
    topology = PaymentConsumer().topology()
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url()))
    try:
        channel = connection.channel()
        declare_topology(channel, topology)
        declare_dead_letter_topology(channel, topology)
    finally:
        connection.close()
    return topology.queue


def main() -> None:
    """Create tables and queues, printing what was done."""
    engine = settings.engine()
    created = init_schema(engine, settings.mqdedup_prefix())
    payments, ledger = config.tables()
    payments.metadata.create_all(engine, checkfirst=True)
    engine.dispose()
    queue = declare_queues()
    print(f"tables: {payments.name}, {ledger.name} and mqdedup's {created or '(existing)'}")
    print(f"queue: {queue} (dead letters: {queue}.dlq)")


if __name__ == "__main__":
    main()
