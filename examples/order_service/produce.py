"""Send orders to Kafka: ``python -m examples.order_service.produce --orders 1000``.

Each order carries its message id in the ``message-id`` header (the id mqdedup's Kafka
consumers read by default). ``--duplicates 0.3`` sends 30% of the orders a second time
with the same id, as a producer retry would; ``--invalid N`` adds N orders with a
negative total, which the consumer dead-letters to ``<topic>.DLT``. Running the script
twice with the same ``--id-prefix`` sends the same ids again: all duplicates.
"""

from __future__ import annotations

import argparse
import json
import random

import kafka

from examples import settings
from examples.order_service import config


def orders(count: int, id_prefix: str, invalid: int) -> list[tuple[str, dict[str, object]]]:
    """``(message id, order)`` pairs: ``count`` valid orders, then ``invalid`` bad ones."""
    result: list[tuple[str, dict[str, object]]] = []
    for n in range(count + invalid):
        order_id = f"{id_prefix}-{n}"
        total = f"{(n % 97) + 1}.50" if n < count else "-1.00"
        order: dict[str, object] = {
            "order_id": order_id,
            "customer": f"customer-{n % 13}",
            "total": total,
        }
        result.append((f"{order_id}-created", order))
    return result


def main(argv: list[str] | None = None) -> None:
    """Produce the orders (and their duplicates) and wait for the broker's acks."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=1000)
    parser.add_argument("--duplicates", type=float, default=0.3, help="share sent twice")
    parser.add_argument("--invalid", type=int, default=0, help="orders with a bad total")
    parser.add_argument("--id-prefix", default="order")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    batch = orders(args.orders, args.id_prefix, args.invalid)
    rng = random.Random(args.seed)
    resent = rng.sample(batch[: args.orders], int(args.orders * args.duplicates))
    producer = kafka.KafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap(), acks="all", linger_ms=5
    )
    topic = config.orders_topic()
    try:
        for message_id, order in batch + resent:
            producer.send(
                topic,
                key=str(order["order_id"]).encode(),
                value=json.dumps(order).encode(),
                headers=[("message-id", message_id.encode())],
            )
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)
    print(
        f"sent {len(batch) + len(resent)} messages to {topic}: {args.orders} orders, "
        f"{len(resent)} duplicates, {args.invalid} invalid"
    )


if __name__ == "__main__":
    main()
