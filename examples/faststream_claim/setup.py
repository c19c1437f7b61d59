"""Create the tables (mqdedup's and the payments table) and, for RabbitMQ, the queue.

``python -m examples.faststream_claim.setup``; idempotent.
"""

from __future__ import annotations

import pika

from examples import settings
from examples.faststream_claim import config
from mqdedup import init_schema


def main() -> None:
    """Create what is missing and say what there is."""
    engine = settings.engine()
    init_schema(engine, settings.mqdedup_prefix())
    table = config.payments_table()
    table.metadata.create_all(engine, checkfirst=True)
    engine.dispose()
    where = f"topic {config.topic()}"
    if config.broker_kind() == "rabbit":
        # Declared before the producer runs: the default exchange drops a message
        # for a queue that does not exist yet.
        connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url()))
        try:
            connection.channel().queue_declare(config.queue(), durable=True)
        finally:
            connection.close()
        where = f"queue {config.queue()}"
    print(f"tables: {table.name} and mqdedup's; {where}")


if __name__ == "__main__":
    main()
