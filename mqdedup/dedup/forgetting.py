"""Forgetting one message id's claim: what ``mqdedup dedup forget`` and the console's
Claims page do (one definition for both)."""

from __future__ import annotations

from sqlalchemy import Engine, delete
from sqlalchemy.orm import Session

from mqdedup.db.schema import schema


def forget_claim(engine: Engine, prefix: str, consumer: str, message_id: str) -> dict[str, int]:
    """Delete ``consumer``'s claim of ``message_id``, its steps and its attempt count (one
    transaction); how many rows of each went (``claims``, ``steps``, ``attempts``).

    The next delivery or replay of the message runs its handler, steps included, again.
    """
    tables = schema(prefix)
    removed: dict[str, int] = {}
    with Session(engine) as session, session.begin():
        for label, table in (
            ("claims", tables.processed),
            ("steps", tables.steps),
            ("attempts", tables.attempts),
        ):
            result = session.execute(
                delete(table).where(
                    table.c.consumer_name == consumer, table.c.message_id == message_id
                )
            )
            removed[label] = int(getattr(result, "rowcount", 0) or 0)
    return removed
