"""Create the flash sale's tables and queues and put stock on sale:
``python -m examples.flash_sale.setup --sku tee --stock 50`` (idempotent; resets the SKU).
"""

from __future__ import annotations

import argparse

import pika
from sqlalchemy import delete, insert

from examples import settings
from examples.flash_sale import config
from examples.flash_sale.consumer import SalePayments
from mqdedup import init_schema
from mqdedup.rabbitmq.topology import declare_dead_letter_topology, declare_topology


def main() -> None:
    """Tables, queues, and ``--stock`` units of ``--sku`` on sale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sku", default="tee")
    parser.add_argument("--stock", type=int, default=50)
    args = parser.parse_args()
    engine = settings.engine()
    init_schema(engine, settings.mqdedup_prefix())
    stock, orders = config.tables()
    stock.metadata.create_all(engine, checkfirst=True)
    with engine.begin() as connection:
        connection.execute(delete(stock).where(stock.c.sku == args.sku))
        connection.execute(
            insert(stock).values(sku=args.sku, initial=args.stock, available=args.stock)
        )
    engine.dispose()
    topology = SalePayments().topology()
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url()))
    try:
        channel = connection.channel()
        declare_topology(channel, topology)
        declare_dead_letter_topology(channel, topology)
        channel.queue_declare(config.events_queue(), durable=True)
    finally:
        connection.close()
    print(f"tables {stock.name}, {orders.name}; {args.stock} units of {args.sku!r} on sale")
    print(f"queues: {topology.queue} (dead letters: {topology.queue}.dlq), {config.events_queue()}")


if __name__ == "__main__":
    main()
