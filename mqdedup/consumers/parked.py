"""A transport over the database's dead-letter table: replaying kept dead letters.

``mqdedup dead-letters replay`` runs a consumer over the dead letters the broker refused
(see :mod:`mqdedup.dedup.dead_letters`) through the same Worker and Processor as live
messages: a row is deleted when its message is settled (processed or a duplicate), and
stays, with the new reason, when it is dead-lettered again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.dead_letters import DeadLetterTable


class ParkedTransport:
    """Hands out kept dead letters of one consumer once each, oldest first.

    ``token`` of each delivery is the row id. Settling deletes the rows (in their own
    short transaction, after the processor's commit); ``dead_letter`` leaves the row in
    place with the new reason, and the later ``settle`` of that delivery keeps it.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        consumer_name: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        ids: Sequence[int] | None = None,
    ) -> None:
        self.sessions = sessions
        self.consumer_name = consumer_name
        self.table = DeadLetterTable(prefix)
        self.ids = list(ids) if ids is not None else None
        self._after_id = 0
        self._kept_again: set[int] = set()
        self._again: list[Delivery[Any]] = []
        self.settled = 0
        self.dead_lettered_again = 0

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[Any]]:
        """The next ``max_messages`` kept dead letters (none left: an empty list)."""
        if self._again:
            batch, self._again = self._again[:max_messages], self._again[max_messages:]
            return batch
        with self.sessions() as session:
            rows = self.table.list(
                session,
                self.consumer_name,
                after_id=self._after_id,
                ids=self.ids,
                limit=max_messages,
            )
        if rows:
            self._after_id = rows[-1].id
        return [Delivery(row.message, row.id) for row in rows]

    def settle(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Delete the rows of messages that are done (not those dead-lettered again)."""
        done = [int(d.token) for d in deliveries if int(d.token) not in self._kept_again]
        if not done:
            return
        with self.sessions() as session, session.begin():
            self.settled += self.table.delete(session, done)

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Hand these unsettled rows out again, first (their rows are still there)."""
        again = [
            Delivery(dataclasses.replace(d.message, redelivered=True), d.token) for d in deliveries
        ]
        self._again = again + self._again

    def dead_letter(self, delivery: Delivery[Any], record: DeadLetter) -> None:
        """The message failed again: its row stays (the reason is logged by the worker)."""
        self._kept_again.add(int(delivery.token))
        self.dead_lettered_again += 1

    def keepalive(self) -> None:
        """Nothing to keep alive."""

    def close(self) -> None:
        """Nothing to release: rows not yet settled simply stay."""
