"""Create the service's tables and topic: ``python -m examples.fastapi_orders.setup``.

Idempotent: mqdedup's tables (``mqdedup db init`` does the same), the orders and
shipments tables and the events topic are created only when missing.
"""

from __future__ import annotations

import argparse

from examples import settings
from examples.fastapi_orders import config
from examples.order_service.setup import create_topics
from mqdedup import init_schema


def main(argv: list[str] | None = None) -> None:
    """Create tables and topic, printing what was done."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--partitions", type=int, default=3, help="partitions of a new topic")
    args = parser.parse_args(argv)
    engine = settings.engine()
    created = init_schema(engine, settings.mqdedup_prefix())
    orders, shipments = config.tables()
    orders.metadata.create_all(engine, checkfirst=True)
    engine.dispose()
    topics = create_topics(settings.kafka_bootstrap(), [config.events_topic()], args.partitions)
    print(f"tables: {orders.name}, {shipments.name} and mqdedup's {created or '(existing)'}")
    print(f"topics created: {topics or '(existing)'}")


if __name__ == "__main__":
    main()
