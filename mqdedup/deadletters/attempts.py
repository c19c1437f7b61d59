"""Forgetting attempt counts before a dead letter goes back to its consumer."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.deadletters.records import DeadLetterRecord
from mqdedup.dedup.store import DedupStore


def forget_attempts(
    engine: Engine, records: Iterable[DeadLetterRecord], prefix: str = DEFAULT_PREFIX
) -> None:
    """Remove the attempt counts of these records' messages (by their consumer and
    message id), so a requeued or replayed message gets its full retries again."""
    by_consumer: dict[str, set[str]] = {}
    for record in records:
        if record.consumer is not None and record.message_id is not None:
            by_consumer.setdefault(record.consumer, set()).add(record.message_id)
    if not by_consumer:
        return
    store = DedupStore(prefix)
    with Session(engine) as session, session.begin():
        for consumer, ids in sorted(by_consumer.items()):
            store.forget_attempts(consumer, sorted(ids), session)
