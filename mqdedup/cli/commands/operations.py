"""``mqdedup dedup stats``, ``mqdedup outbox …`` and ``mqdedup status``."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select

from mqdedup.cli.commands.tables import human_age, render_table
from mqdedup.db.dialects import table_size
from mqdedup.db.engine import create_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.store import utcnow
from mqdedup.outbox.store import OutboxStore
from mqdedup.outbox.writer import PUBLISHED

log = logging.getLogger(__name__)
#: How ``outbox status`` shows RabbitMQ's default (nameless) exchange.
DEFAULT_EXCHANGE = "(default exchange)"


@dataclass(frozen=True)
class ConsumerStats:
    """Dedup records of one consumer name."""

    consumer: str
    rows: int
    oldest: datetime | None
    newest: datetime | None


def dedup_stats(engine: Engine, prefix: str) -> tuple[list[ConsumerStats], int | None]:
    """Rows per consumer with oldest/newest claim, and the table size in bytes (PostgreSQL)."""
    # A full read of the table with any index: the retention index (BRIN on PostgreSQL,
    # a btree elsewhere) has no per-consumer order for min/max to use.
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
        size = table_size(connection, table.name)
    return [ConsumerStats(r[0], int(r[1]), r[2], r[3]) for r in rows], size


def dedup_stats_data(stats: list[ConsumerStats], size: int | None) -> dict[str, Any]:
    """``dedup stats --json``: stable keys, times in ISO-8601 UTC, ages in seconds."""
    now = utcnow()
    return {
        "consumers": [
            {
                "consumer": s.consumer,
                "records": s.rows,
                "oldest": _iso(s.oldest),
                "newest": _iso(s.newest),
                "oldest_age_seconds": _age(now, s.oldest),
                "newest_age_seconds": _age(now, s.newest),
            }
            for s in stats
        ],
        "records": sum(s.rows for s in stats),
        "size_bytes": size,
    }


def format_dedup_stats(stats: list[ConsumerStats], size: int | None) -> str:
    """The ``dedup stats`` screen."""
    return format_dedup_stats_data(dedup_stats_data(stats, size))


def format_dedup_stats_data(data: dict[str, Any]) -> str:
    """The ``dedup stats`` screen, from :func:`dedup_stats_data`."""
    rows = [
        (
            c["consumer"],
            c["records"],
            human_age(c["oldest_age_seconds"]),
            human_age(c["newest_age_seconds"]),
        )
        for c in data["consumers"]
    ]
    size = data["size_bytes"]
    lines = [render_table(["consumer", "records", "oldest", "newest"], rows)]
    lines.append(
        f"\n{data['records']:,} records"
        + (f", {size / 1_048_576:,.1f} MiB on disk" if size else "")
    )
    return "\n".join(lines)


def count_purgeable_claims(
    engine: Engine, prefix: str, older_than: timedelta, consumer: str | None
) -> int:
    """How many claims ``dedup purge --older-than`` would delete (``--dry-run``)."""
    # On PostgreSQL a Bitmap Heap Scan of the block ranges the BRIN index on processed_at
    # leaves in (schema 3; a btree range scan before), as the purge's chunks read them.
    table = schema(prefix).processed
    query = select(func.count()).where(table.c.processed_at < utcnow() - older_than)
    if consumer is not None:
        query = query.where(table.c.consumer_name == consumer)
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def count_purgeable_outbox_rows(engine: Engine, prefix: str, older_than: timedelta) -> int:
    """How many published rows ``outbox purge --older-than`` would delete (``--dry-run``)."""

    table = schema(prefix).outbox
    query = select(func.count()).where(
        table.c.state == PUBLISHED, table.c.published_at < utcnow() - older_than
    )
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def _age(now: datetime, then: datetime | None) -> float | None:
    if then is None:
        return None
    if then.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
        then = then.replace(tzinfo=now.tzinfo)
    return max(0.0, (now - then).total_seconds())


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    if moment.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
        moment = moment.replace(tzinfo=UTC)
    return moment.isoformat()


def display_destination(broker: str, destination: str) -> str:
    """A destination as shown in tables: RabbitMQ's nameless exchange gets a name."""
    if not destination and broker == "rabbitmq":
        return DEFAULT_EXCHANGE
    return destination or "-"


def outbox_status_data(engine: Engine, prefix: str) -> dict[str, Any]:
    """``outbox status --json``: stable keys (a destination is ``""`` for the default exchange)."""

    status = OutboxStore(prefix).status(engine)
    return {
        "pending": status.pending,
        "failed": status.failed,
        "published": status.published,
        "oldest_pending_age_seconds": status.oldest_pending_age,
        "destinations": [
            {
                "broker": d.broker,
                "destination": d.destination,
                "pending": d.pending,
                "failed": d.failed,
                "published": d.published,
                "oldest_pending_age_seconds": d.oldest_pending_age,
            }
            for d in status.destinations
        ],
    }


def format_outbox_status(engine: Engine, prefix: str) -> str:
    """The ``outbox status`` screen: totals and per destination."""
    return format_outbox_status_data(outbox_status_data(engine, prefix))


def format_outbox_status_data(data: dict[str, Any]) -> str:
    """The ``outbox status`` screen, from :func:`outbox_status_data`."""
    rows = [
        (
            d["broker"],
            display_destination(d["broker"], d["destination"]),
            d["pending"],
            d["failed"],
            d["published"],
            human_age(d["oldest_pending_age_seconds"]),
        )
        for d in data["destinations"]
    ]
    table = render_table(
        ["broker", "destination", "pending", "failed", "published", "oldest pending"], rows
    )
    summary = (
        f"\npending {data['pending']:,}  failed {data['failed']:,}  "
        f"published {data['published']:,}"
        f"  oldest pending {human_age(data['oldest_pending_age_seconds'])}"
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
