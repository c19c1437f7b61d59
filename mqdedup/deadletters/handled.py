"""Marks on dead letters a place cannot remove: ``<prefix>handled_dead_letters``.

A Kafka topic cannot drop one record. A dead letter deleted, replayed or requeued from a
dead-letter topic is marked here instead, by its place and key, and the place no longer
lists, shows or counts it. The table is created by ``mqdedup db init`` / ``db upgrade``
(:func:`mqdedup.db.engine.init_schema`) with the framework's other tables.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from mqdedup.db import dialects
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import id_chunks, utcnow

#: What happened to a marked dead letter.
ACTIONS = ("deleted", "replayed", "requeued")


class HandledMarks:
    """Reads and writes the marks of one place (``kafka``)."""

    def __init__(self, engine: Engine, place: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.engine = engine
        self.place = place
        self.table = schema(prefix).handled_dead_letters

    def mark(self, keys: Iterable[str], action: str) -> int:
        """Mark ``keys`` handled by ``action``; returns how many were not marked before."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        wanted = sorted(set(keys))
        if not wanted:
            return 0
        with Session(self.engine) as session, session.begin():
            before = self._marked(session, wanted)
            fresh = [key for key in wanted if key not in before]
            for key in fresh:
                dialects.insert_unless_present(
                    session,
                    self.table,
                    {
                        "place": self.place,
                        "dead_letter_key": key,
                        "action": action,
                        "handled_at": utcnow(),
                    },
                )
        return len(fresh)

    def marked(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` are marked."""
        wanted = sorted(set(keys))
        if not wanted:
            return set()
        with Session(self.engine) as session:
            return self._marked(session, wanted)

    def marked_with_prefix(self, prefix: str) -> set[str]:
        """Every marked key starting with ``prefix`` (e.g. a topic's ``orders.DLT:``)."""
        table = self.table
        query = select(table.c.dead_letter_key).where(
            table.c.place == self.place,
            func.substr(table.c.dead_letter_key, 1, len(prefix)) == prefix,
        )
        with Session(self.engine) as session:
            return {str(key) for (key,) in session.execute(query)}

    def _marked(self, session: Session, wanted: list[str]) -> set[str]:
        table = self.table
        found: set[str] = set()
        for chunk in id_chunks(session, wanted):
            query = select(table.c.dead_letter_key).where(
                table.c.place == self.place, table.c.dead_letter_key.in_(list(chunk))
            )
            found.update(str(key) for (key,) in session.execute(query))
        return found
