"""What the payment service did: ``python -m examples.payments.report``.

Prints payments by status, ledger entries by kind, payments captured or refunded more
than once (must be 0), and the handler outcomes stored with the dedup claims. Exits 1
if money moved twice.
"""

from __future__ import annotations

import sys
from typing import Any

from sqlalchemy import Engine, func, select

from examples import settings
from examples.payments import config
from mqdedup.db.schema import schema


def counts(engine: Engine) -> dict[str, Any]:
    """The report's figures."""
    payments, ledger = config.tables()
    processed = schema(settings.mqdedup_prefix()).processed
    with engine.connect() as connection:
        statuses: dict[str, int] = dict(
            connection.execute(
                select(payments.c.status, func.count()).group_by(payments.c.status)
            ).all()
        )
        entries: dict[str, int] = dict(
            connection.execute(select(ledger.c.entry, func.count()).group_by(ledger.c.entry)).all()
        )
        per_payment = (
            select(ledger.c.payment_id, ledger.c.entry)
            .group_by(ledger.c.payment_id, ledger.c.entry)
            .having(func.count() > 1)
            .subquery()
        )
        doubled = connection.execute(select(func.count()).select_from(per_payment)).scalar_one()
        results = connection.execute(
            select(processed.c.result).where(processed.c.consumer_name == config.payments_queue())
        ).scalars()
        outcomes: dict[str, int] = {}
        for result in results:
            outcome = str((result or {}).get("outcome", "none")).split(":")[0]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return {
        "statuses": statuses,
        "ledger entries": entries,
        "money moved twice": doubled,
        "handler outcomes": outcomes,
    }


def main() -> None:
    """Print the figures; exit 1 when a capture or refund was booked twice."""
    engine = settings.engine()
    figures = counts(engine)
    engine.dispose()
    for name, value in figures.items():
        print(f"  {name:<20}{value}")
    if figures["money moved twice"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
