"""The SQL claim store: the dedup table, inside the handler's database transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from mqdedup.db.dialects import is_transient
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.claims import Claims
from mqdedup.dedup.dead_letters import clean_text
from mqdedup.dedup.store import DedupStore


class SqlClaimStore:
    """:class:`~mqdedup.dedup.claims.ClaimStore` over ``<prefix>processed_messages``.

    ``unit`` is the ``Session`` of the business transaction: a claim is the first
    statement of it (``INSERT … ON CONFLICT DO NOTHING RETURNING``), so a concurrent
    duplicate blocks on the unique index until the first transaction ends. Attempt
    counts (and careful mode's counted-before-running attempts) use short transactions
    of their own from ``sessions``.
    """

    transactional = True
    infrastructure = "database"
    lease: float | None = None

    def __init__(self, sessions: sessionmaker[Session], prefix: str = DEFAULT_PREFIX) -> None:
        self.sessions = sessions
        self.table = DedupStore(prefix)

    def is_transient(self, error: BaseException) -> bool:
        """Connection losses, deadlocks, serialization failures (see ``db.dialects``)."""
        return isinstance(error, Exception) and is_transient(error)

    def claim(self, unit: Session, consumer: str, ids: Sequence[str]) -> Claims:
        """Claim ``ids`` in the transaction; ``done`` is left empty (see :meth:`results`)."""
        return Claims(new=self.table.claim(unit, consumer, ids))

    def results(self, unit: Session, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """Stored results of processed ids, read in the transaction."""
        return self.table.results(unit, consumer, ids)

    def save_results(self, unit: Session, consumer: str, results: Mapping[str, Any]) -> None:
        """Store results next to their claims (``None`` results need no write)."""
        self.table.save_results(
            unit, consumer, {key: value for key, value in results.items() if value is not None}
        )

    def forget(self, unit: Session, consumer: str, ids: Sequence[str]) -> None:
        """Delete failed handlers' claims in the transaction."""
        self.table.forget(unit, consumer, ids)

    def renew(self, unit: Session, consumer: str, ids: Sequence[str]) -> None:
        """Nothing: a claim is held until its transaction ends."""

    def record_failure(self, consumer: str, message_id: str, error: str) -> int:
        """Count a failed attempt in a transaction of its own."""
        with self.sessions() as session, session.begin():
            # The error text may carry NUL or a lone surrogate, which PostgreSQL refuses.
            return self.table.record_failure(session, consumer, message_id, clean_text(error))

    def forget_attempts(self, consumer: str, ids: Sequence[str]) -> None:
        """Delete attempt counts in a transaction of their own."""
        with self.sessions() as session, session.begin():
            self.table.forget_attempts(session, consumer, ids)

    # -- careful mode: attempts counted before the handler runs ---------------------------

    def processed(self, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """The ids among ``ids`` with a committed claim, with stored results (one read)."""
        with self.sessions() as session, session.begin():
            return self.table.processed(session, consumer, ids)

    def start_attempt(
        self, unit: Session, consumer: str, message_id: str, marker: str, max_attempts: int
    ) -> tuple[int, str | None, bool]:
        """Count an attempt before its handler runs, in ``unit``'s own transaction."""
        with unit.begin():
            return self.table.start_attempt(unit, consumer, message_id, marker, max_attempts)

    def finish_attempt(self, consumer: str, message_id: str, error: str) -> None:
        """Record how a counted attempt failed (no second count)."""
        with self.sessions() as session, session.begin():
            self.table.finish_attempt(session, consumer, message_id, clean_text(error))

    def undo_attempt(self, consumer: str, message_id: str) -> None:
        """Take back a counted attempt whose handler never ran."""
        with self.sessions() as session, session.begin():
            self.table.undo_attempt(session, consumer, message_id)
