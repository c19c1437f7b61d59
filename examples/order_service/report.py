"""What the order service did: ``python -m examples.order_service.report``.

Prints the orders written, orders written more than once (must be 0), the order events
pending / published / failed in the outbox, and the dedup records of the consumer.
Exits 1 if an order was doubled.
"""

from __future__ import annotations

import sys

from sqlalchemy import Engine, func, select

from examples import settings
from examples.order_service import config
from mqdedup.db.schema import schema
from mqdedup.outbox.store import DestinationStatus, OutboxStore


def counts(engine: Engine) -> dict[str, int]:
    """The report's figures."""
    orders = config.orders_table()
    tables = schema(settings.mqdedup_prefix())
    with engine.connect() as connection:
        rows = connection.execute(select(func.count()).select_from(orders)).scalar_one()
        distinct = connection.execute(
            select(func.count(func.distinct(orders.c.order_id)))
        ).scalar_one()
        claims = connection.execute(
            select(func.count())
            .select_from(tables.processed)
            .where(tables.processed.c.consumer_name == config.group_id())
        ).scalar_one()
    # Published rows are deleted and counted per destination (the relay's default), so
    # the outbox's status answers, not a count of rows by state.
    status = OutboxStore(settings.mqdedup_prefix()).status(engine)
    events = next(
        (d for d in status.destinations if d.destination == config.events_topic()),
        DestinationStatus("kafka", config.events_topic()),
    )
    return {
        "order rows": rows,
        "distinct orders": distinct,
        "orders written more than once": rows - distinct,
        "outbox pending": events.pending,
        "outbox published": events.published,
        "outbox failed": events.failed,
        "dedup records": claims,
    }


def main() -> None:
    """Print the figures; exit 1 when an order was written twice."""
    engine = settings.engine()
    figures = counts(engine)
    engine.dispose()
    for name, value in figures.items():
        print(f"  {name:<32}{value:>8}")
    if figures["orders written more than once"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
