"""What the database holds: ``python -m examples.faststream_claim.report``.

Exits 1 when a message id was charged more than once.
"""

from __future__ import annotations

import sys

from sqlalchemy import func, select

from examples import settings
from examples.faststream_claim import config
from mqdedup.db.schema import schema


def counts() -> tuple[int, int, int]:
    """(payment rows, distinct message ids among them, claims of the consumer)."""
    table = config.payments_table()
    processed = schema(settings.mqdedup_prefix()).processed
    engine = settings.engine()
    try:
        with engine.connect() as connection:
            rows, ids = connection.execute(
                select(func.count(), func.count(table.c.message_id.distinct()))
            ).one()
            claims = connection.execute(
                select(func.count())
                .select_from(processed)
                .where(processed.c.consumer_name == config.consumer_name())
            ).scalar_one()
    finally:
        engine.dispose()
    return int(rows), int(ids), int(claims)


def main() -> None:
    rows, ids, claims = counts()
    name = config.consumer_name()
    print(f"payments: {rows} rows for {ids} message ids; claims of {name}: {claims}")
    if rows != ids:
        print("a message was charged twice", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
