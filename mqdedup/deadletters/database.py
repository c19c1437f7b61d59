"""The ``database`` place: dead letters the broker refused, kept in ``<prefix>dead_letters``.

Keys are the row ids. :meth:`DatabaseDeadLetters.requeue` refuses: these dead letters
are here because the broker refused them (too large for the topic, refused by a queue
policy), so a copy sent back would most likely be refused again; replay them through the
consumer instead (:func:`mqdedup.deadletters.replay.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.deadletters.records import (
    DeadLetterKeyError,
    DeadLetterRecord,
    Place,
    error_key,
    text_headers,
)
from mqdedup.dedup.dead_letters import DeadLetterTable, ParkedDeadLetter
from mqdedup.errors import ConfigurationError

PLACE: Final[Place] = "database"


class DatabaseDeadLetters:
    """The dead letters kept in the database (a :class:`DeadLetterPlace`)."""

    place: Place = PLACE

    def __init__(self, engine: Engine, prefix: str = DEFAULT_PREFIX) -> None:
        self.engine = engine
        self.prefix = prefix
        self.table = DeadLetterTable(prefix)

    def list(self, *, consumer: str | None = None, limit: int = 100) -> list[DeadLetterRecord]:
        """Up to ``limit`` kept dead letters, oldest first."""
        with Session(self.engine) as session:
            rows = self.table.list(session, consumer, limit=limit)
        return [record_of(row) for row in rows]

    def get(self, key: str) -> DeadLetterRecord | None:
        """The kept dead letter with row id ``key``."""
        row_id = row_id_of(key)
        with Session(self.engine) as session:
            rows = self.table.list(session, ids=[row_id], limit=1)
        return record_of(rows[0]) if rows else None

    def depth(self) -> int:
        """How many dead letters are kept (every consumer)."""
        with Session(self.engine) as session:
            return sum(self.table.counts(session).values())

    def counts(self) -> dict[str, int]:
        """How many dead letters are kept, per consumer name."""
        with Session(self.engine) as session:
            return self.table.counts(session)

    def delete(self, keys: Sequence[str]) -> int:
        """Delete the rows ``keys``."""
        ids = [row_id_of(key) for key in keys]
        with Session(self.engine) as session, session.begin():
            return self.table.delete(session, sorted(set(ids)))

    def requeue(self, keys: Sequence[str]) -> int:
        """Refused: the broker refused these once; replay them through the consumer."""
        raise ConfigurationError(
            "dead letters kept in the database were refused by the broker and cannot be "
            "requeued to it; replay them through the consumer instead "
            "(mqdedup dead-letters replay --place database MODULE:CLASS --key ID)"
        )


def row_id_of(key: str) -> int:
    """The row id a ``database`` key names."""
    text = key.strip()
    if not text.isdigit():
        raise DeadLetterKeyError(f"{key!r} is not a key of the database place (a row id, e.g. 42)")
    return int(text)


def record_of(row: ParkedDeadLetter) -> DeadLetterRecord:
    """The :class:`DeadLetterRecord` of one kept dead letter."""
    message = row.message
    return DeadLetterRecord(
        place=PLACE,
        key=str(row.id),
        consumer=row.consumer_name,
        source=message.coordinates,
        message_id=message.id,
        error=error_key(row.error_class, row.reason, row.error_message),
        reason=row.reason,
        attempts=row.attempts,
        headers=text_headers(message.headers),
        body=message.body,
        dead_lettered_at=row.parked_at,
        message=message,
        refusal=row.refusal,
    )
