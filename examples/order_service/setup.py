"""Create the order service's tables and topics: ``python -m examples.order_service.setup``.

Idempotent: mqdedup's tables (``mqdedup db init`` does the same), the orders table and
the two Kafka topics are created only when missing.
"""

from __future__ import annotations

import argparse

import kafka

from examples import settings
from examples.order_service import config
from mqdedup import init_schema


def create_topics(bootstrap: str, topics: list[str], partitions: int) -> list[str]:
    """Create the missing ``topics``; return the ones created."""
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
    try:
        missing = [topic for topic in topics if topic not in set(admin.list_topics())]
        if missing:
            admin.create_topics(
                {topic: {"num_partitions": partitions} for topic in missing},
                wait_for_metadata=True,
            )
        return missing
    finally:
        admin.close()


def main(argv: list[str] | None = None) -> None:
    """Create tables and topics, printing what was done."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--partitions", type=int, default=3, help="partitions of new topics")
    args = parser.parse_args(argv)
    engine = settings.engine()
    created = init_schema(engine, settings.mqdedup_prefix())
    config.orders_table().create(engine, checkfirst=True)
    engine.dispose()
    topics = create_topics(
        settings.kafka_bootstrap(), [config.orders_topic(), config.events_topic()], args.partitions
    )
    print(f"tables: {config.orders_table().name} and mqdedup's {created or '(existing)'}")
    print(f"topics created: {topics or '(existing)'}")


if __name__ == "__main__":
    main()
