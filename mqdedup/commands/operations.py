"""``mqdedup dedup stats``, ``mqdedup outbox …`` and ``mqdedup status``."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, func, select, text

from mqdedup.commands.tables import human_age, render_table
from mqdedup.dedup.store import utcnow
from mqdedup.schema import schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsumerStats:
    """Dedup records of one consumer name."""

    consumer: str
    rows: int
    oldest: datetime | None
    newest: datetime | None


def dedup_stats(engine: Engine, prefix: str) -> tuple[list[ConsumerStats], int | None]:
    """Rows per consumer with oldest/newest claim, and the table size in bytes (PostgreSQL)."""
    table = schema(prefix).processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(
                table.c.consumer_name,
                func.count(),
                func.min(table.c.processed_at),
                func.max(table.c.processed_at),
            )
            .group_by(table.c.consumer_name)
            .order_by(table.c.consumer_name)
        ).all()
        size = None
        if engine.dialect.name == "postgresql":
            size = connection.execute(
                text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": table.name}
            ).scalar()
    return [ConsumerStats(r[0], int(r[1]), r[2], r[3]) for r in rows], size


def format_dedup_stats(stats: list[ConsumerStats], size: int | None) -> str:
    """The ``dedup stats`` screen."""
    now = utcnow()
    rows = [
        (s.consumer, s.rows, human_age(_age(now, s.oldest)), human_age(_age(now, s.newest)))
        for s in stats
    ]
    total = sum(s.rows for s in stats)
    lines = [render_table(["consumer", "records", "oldest", "newest"], rows)]
    lines.append(
        f"\n{total:,} records" + (f", {size / 1_048_576:,.1f} MiB on disk" if size else "")
    )
    return "\n".join(lines)


def _age(now: datetime, then: datetime | None) -> float | None:
    if then is None:
        return None
    if then.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
        then = then.replace(tzinfo=now.tzinfo)
    return max(0.0, (now - then).total_seconds())


def format_outbox_status(engine: Engine, prefix: str) -> str:
    """The ``outbox status`` screen: totals and per destination."""
    from mqdedup.outbox.store import OutboxStore

    status = OutboxStore(prefix).status(engine)
    rows = [
        (d.broker, d.destination, d.pending, d.failed, d.published, human_age(d.oldest_pending_age))
        for d in status.destinations
    ]
    table = render_table(
        ["broker", "destination", "pending", "failed", "published", "oldest pending"], rows
    )
    summary = (
        f"\npending {status.pending:,}  failed {status.failed:,}  published {status.published:,}"
        f"  oldest pending {human_age(status.oldest_pending_age)}"
    )
    return table + summary


class OutboxGauges:
    """The outbox backlog for ``/metrics``, read at most every ``max_age`` seconds."""

    def __init__(self, database_url: str, prefix: str, max_age: float = 5.0) -> None:
        self.database_url = database_url
        self.prefix = prefix
        self.max_age = max_age
        self._engine: Engine | None = None
        self._value: dict[str, float] = {}
        self._read_at = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, float]:
        """``{"backlog": pending rows, "oldest_pending_seconds": age}`` ({} if unreadable)."""
        from mqdedup.db import create_engine
        from mqdedup.outbox.store import OutboxStore

        with self._lock:
            if time.monotonic() - self._read_at < self.max_age:
                return self._value
            self._read_at = time.monotonic()
            try:
                if self._engine is None:
                    self._engine = create_engine(self.database_url, pool_size=1)
                status = OutboxStore(self.prefix).status(self._engine)
            except Exception:  # a scrape must not fail because the database is away
                log.warning("outbox backlog unavailable", exc_info=True)
                self._value = {}
                return self._value
            self._value = {
                "backlog": float(status.pending),
                "oldest_pending_seconds": float(status.oldest_pending_age or 0.0),
            }
            return self._value
