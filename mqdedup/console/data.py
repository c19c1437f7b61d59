"""What the console reads from and writes to the framework's tables.

Throughput comes from the claims themselves: every processed message left a row with
its ``processed_at`` in ``<prefix>processed_messages``, so processed-per-minute and the
age of each consumer's last commit are counts over that table (the retention purge
bounds how far back they reach). Claims, steps, the outbox and relay leases are read
with the stores' own tables; the console's actions go through the stores
(:class:`~mqdedup.dedup.store.DedupStore`, :class:`~mqdedup.outbox.store.OutboxStore`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, insert, select

from mqdedup.db.schema import schema
from mqdedup.dedup.store import utcnow
from mqdedup.outbox.store import OutboxStore
from mqdedup.outbox.writer import FAILED

#: Claims read per overview when the database cannot count per minute itself.
_PYTHON_BUCKET_LIMIT = 200_000


def aware(moment: datetime) -> datetime:
    """``moment`` in UTC (SQLite hands back naive timestamps)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def processed_per_minute(
    engine: Engine, prefix: str, since: datetime
) -> dict[str, dict[datetime, int]]:
    """Per consumer name, the claims committed in each minute since ``since``."""
    table = schema(prefix).processed
    out: dict[str, dict[datetime, int]] = {}
    with engine.connect() as connection:
        if engine.dialect.name == "postgresql":
            minute = func.date_trunc("minute", table.c.processed_at)
            rows = connection.execute(
                select(table.c.consumer_name, minute, func.count())
                .where(table.c.processed_at >= since)
                .group_by(table.c.consumer_name, minute)
            ).all()
            for name, bucket, count in rows:
                out.setdefault(name, {})[aware(bucket)] = int(count)
            return out
        rows = connection.execute(
            select(table.c.consumer_name, table.c.processed_at)
            .where(table.c.processed_at >= since)
            .limit(_PYTHON_BUCKET_LIMIT)
        ).all()
    for name, moment in rows:
        bucket = aware(moment).replace(second=0, microsecond=0)
        counts = out.setdefault(name, {})
        counts[bucket] = counts.get(bucket, 0) + 1
    return out


def last_commits(engine: Engine, prefix: str) -> dict[str, datetime]:
    """Per consumer name, the newest claim's ``processed_at`` (its last commit)."""
    table = schema(prefix).processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.consumer_name, func.max(table.c.processed_at)).group_by(
                table.c.consumer_name
            )
        ).all()
    return {name: aware(moment) for name, moment in rows if moment is not None}


@dataclass(frozen=True)
class Lease:
    """One relay's lease on outbox shards."""

    relay_id: str
    shards: str
    locked_until: datetime


def relay_leases(engine: Engine, prefix: str) -> list[Lease]:
    """The relays' current leases (``<prefix>outbox_leases``)."""
    table = schema(prefix).outbox_leases
    with engine.connect() as connection:
        rows = connection.execute(select(table).order_by(table.c.relay_id)).all()
    return [Lease(r.relay_id, r.shards, aware(r.locked_until)) for r in rows]


def outbox_status(engine: Engine, prefix: str) -> Any:
    """:meth:`OutboxStore.status` (backlog, oldest due row, failed, per destination)."""
    return OutboxStore(prefix).status(engine)


@dataclass(frozen=True)
class FailedRow:
    """An outbox row the relay gave up on."""

    id: int
    message_id: str
    broker: str
    destination: str
    attempts: int
    last_error: str
    created_at: datetime


def failed_outbox_rows(engine: Engine, prefix: str, limit: int = 200) -> list[FailedRow]:
    """Failed outbox rows, oldest first."""
    table = schema(prefix).outbox
    with engine.connect() as connection:
        rows = connection.execute(
            select(
                table.c.id,
                table.c.message_id,
                table.c.broker,
                table.c.destination,
                table.c.attempts,
                table.c.last_error,
                table.c.created_at,
            )
            .where(table.c.state == FAILED)
            .order_by(table.c.id)
            .limit(limit)
        ).all()
    return [
        FailedRow(
            r.id,
            r.message_id,
            r.broker,
            r.destination,
            r.attempts,
            r.last_error or "",
            aware(r.created_at),
        )
        for r in rows
    ]


def retry_outbox(engine: Engine, prefix: str, ids: list[int] | None) -> int:
    """Put failed rows back to pending (``ids``, or all of them); return how many."""
    return OutboxStore(prefix).retry_failed(engine, ids=ids)


@dataclass(frozen=True)
class Claim:
    """What the database holds about one message id of one consumer."""

    consumer: str
    message_id: str
    processed_at: datetime | None
    result: Any
    attempts: int | None
    last_error: str | None
    steps: list[dict[str, Any]]

    @property
    def found(self) -> bool:
        """Whether anything is recorded for it."""
        return self.processed_at is not None or self.attempts is not None or bool(self.steps)


def find_claim(engine: Engine, prefix: str, consumer: str, message_id: str) -> Claim:
    """The claim, the attempt counter and the recorded steps of one message id."""
    tables = schema(prefix)
    processed, attempts, steps = tables.processed, tables.attempts, tables.steps
    with engine.connect() as connection:
        claim = connection.execute(
            select(processed.c.processed_at, processed.c.result).where(
                processed.c.consumer_name == consumer, processed.c.message_id == message_id
            )
        ).first()
        attempt = connection.execute(
            select(attempts.c.attempts, attempts.c.last_error).where(
                attempts.c.consumer_name == consumer, attempts.c.message_id == message_id
            )
        ).first()
        recorded = connection.execute(
            select(steps)
            .where(steps.c.consumer_name == consumer, steps.c.message_id == message_id)
            .order_by(steps.c.started_at)
        ).all()
    return Claim(
        consumer=consumer,
        message_id=message_id,
        processed_at=aware(claim.processed_at) if claim is not None else None,
        result=claim.result if claim is not None else None,
        attempts=attempt.attempts if attempt is not None else None,
        last_error=attempt.last_error if attempt is not None else None,
        steps=[dict(row._mapping) for row in recorded],
    )


def consumer_names(engine: Engine, prefix: str) -> list[str]:
    """Every consumer name with claims."""
    table = schema(prefix).processed
    with engine.connect() as connection:
        return list(
            connection.execute(
                select(table.c.consumer_name).distinct().order_by(table.c.consumer_name)
            )
            .scalars()
            .all()
        )


@dataclass(frozen=True)
class AuditEntry:
    """One row of ``<prefix>audit``."""

    id: int
    at: datetime
    actor: str
    action: str
    target: str
    messages: int
    outcome: str


def audit(
    engine: Engine, prefix: str, actor: str, action: str, target: str, messages: int, outcome: str
) -> None:
    """Write one audit row (its own transaction)."""
    table = schema(prefix).audit
    with engine.begin() as connection:
        connection.execute(
            insert(table).values(
                at=utcnow(),
                actor=actor[:255],
                action=action[:64],
                target=target,
                messages=messages,
                outcome=outcome,
            )
        )


def recent_audit(engine: Engine, prefix: str, limit: int = 100) -> list[AuditEntry]:
    """The newest audit rows first."""
    table = schema(prefix).audit
    with engine.connect() as connection:
        rows = connection.execute(select(table).order_by(table.c.id.desc()).limit(limit)).all()
    return [
        AuditEntry(r.id, aware(r.at), r.actor, r.action, r.target, r.messages, r.outcome)
        for r in rows
    ]


def window_start(hours: float) -> datetime:
    """The start of the overview's window, ``hours`` back from now."""
    return utcnow() - timedelta(hours=hours)
