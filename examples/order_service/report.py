"""What the order service did: ``python -m examples.order_service.report``.

Prints the orders written, orders written more than once (must be 0), the outbox rows
by state, and the dedup records of the consumer. Exits 1 if an order was doubled.
"""

from __future__ import annotations

import sys

from sqlalchemy import Engine, func, select

from examples import settings
from examples.order_service import config
from mqdedup.db.schema import schema


def counts(engine: Engine) -> dict[str, int]:
    """The report's figures."""
    orders = config.orders_table()
    tables = schema(settings.mqdedup_prefix())
    with engine.connect() as connection:
        rows = connection.execute(select(func.count()).select_from(orders)).scalar_one()
        distinct = connection.execute(
            select(func.count(func.distinct(orders.c.order_id)))
        ).scalar_one()
        outbox: dict[str, int] = dict(
            connection.execute(
                select(tables.outbox.c.state, func.count())
                .where(tables.outbox.c.destination == config.events_topic())
                .group_by(tables.outbox.c.state)
            ).all()
        )
        claims = connection.execute(
            select(func.count())
            .select_from(tables.processed)
            .where(tables.processed.c.consumer_name == config.group_id())
        ).scalar_one()
    return {
        "order rows": rows,
        "distinct orders": distinct,
        "orders written more than once": rows - distinct,
        "outbox pending": outbox.get("pending", 0),
        "outbox published": outbox.get("published", 0),
        "outbox failed": outbox.get("failed", 0),
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
