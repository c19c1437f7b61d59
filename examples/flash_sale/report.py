"""The report: ``python -m examples.flash_sale.report`` (exit status 1 if a unit was sold
twice or an order was charged twice)."""

from __future__ import annotations

import argparse
import sys

import pika
from sqlalchemy import func, select

from examples import settings
from examples.flash_sale import config


def main() -> int:
    """Print stock, orders by status and charges; 1 if something happened twice."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sku", default="tee")
    args = parser.parse_args()
    stock, orders = config.tables()
    engine = settings.engine()
    with engine.connect() as connection:
        initial, available = connection.execute(
            select(stock.c.initial, stock.c.available).where(stock.c.sku == args.sku)
        ).one()
        sold = connection.execute(
            select(func.coalesce(func.sum(orders.c.quantity), 0)).where(orders.c.sku == args.sku)
        ).scalar_one()
        statuses = dict(
            connection.execute(
                select(orders.c.status, func.count()).group_by(orders.c.status)
            ).all()
        )
        charges = connection.execute(
            select(func.count(orders.c.charge_id), func.count(orders.c.charge_id.distinct()))
        ).one()
    engine.dispose()
    broker = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url()))
    try:  # the events the relay published (nobody consumes them in the example)
        events = broker.channel().queue_declare(config.events_queue(), passive=True)
    finally:
        broker.close()
    oversold = sold + available - initial
    print(f"  stock               {initial} on sale, {available} left, {sold} sold")
    print(f"  orders              {dict(sorted(statuses.items()))}")
    print(f"  charges             {charges[0]} ({charges[0] - charges[1]} charged twice)")
    print(f"  order paid events   {events.method.message_count} on {config.events_queue()}")
    print(f"  units sold twice    {oversold}")
    return 1 if oversold or charges[0] != charges[1] else 0


if __name__ == "__main__":
    sys.exit(main())
