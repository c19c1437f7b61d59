"""The outbox table's statements: claim, mark, retry, purge and status.

Every method runs its own short transaction on the engine (the writer, which runs in
the caller's transaction, lives in :mod:`mqdedup.outbox.writer`). Rows are claimed *by
state* (``pending``, due, not leased), never by "id greater than the last one seen":
a row whose transaction commits late is still found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from mqdedup.dedup.store import utcnow
from mqdedup.outbox.notify import channel_name
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.outbox.writer import FAILED, PENDING, PUBLISHED
from mqdedup.schema import DEFAULT_PREFIX, schema

log = logging.getLogger(__name__)

MAX_ERROR_LENGTH = 2000


@dataclass(frozen=True)
class ShardFilter:
    """Restricts a claim to the shards whose advisory locks a given backend holds.

    The claim reads the owner's locks from ``pg_locks`` in the same statement, so a
    relay whose lock connection died (and whose shards another relay may have taken)
    claims nothing.
    """

    shards: int
    lock_class: int
    backend_pid: int


@dataclass(frozen=True)
class DestinationStatus:
    """Row counts of one destination (broker + topic or exchange)."""

    broker: str
    destination: str
    pending: int = 0
    failed: int = 0
    published: int = 0
    oldest_pending_age: float | None = None


@dataclass(frozen=True)
class OutboxStatus:
    """Row counts of the whole outbox and per destination.

    ``oldest_pending_age`` is how long (seconds) the longest-waiting *due* pending row
    has waited since it became due; ``None`` when nothing is due.
    """

    pending: int
    failed: int
    published: int
    oldest_pending_age: float | None
    destinations: list[DestinationStatus] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A plain copy (for JSON output)."""
        return asdict(self)


class OutboxStore:
    """Statements on ``<prefix>outbox`` used by the relay and by operators."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.table = schema(prefix).outbox
        self.channel = channel_name(prefix)

    # -- the relay's cycle -------------------------------------------------------------------

    def claim(
        self,
        engine: Engine,
        relay_id: str,
        limit: int,
        lease: timedelta,
        *,
        brokers: Collection[str],
        shard_filter: ShardFilter | None = None,
    ) -> list[OutboxRecord]:
        """Lease up to ``limit`` due pending rows for ``brokers``, oldest id first.

        One statement: ``UPDATE … WHERE id IN (SELECT … ORDER BY id LIMIT n FOR UPDATE
        SKIP LOCKED) RETURNING …``. A row is skipped while an earlier row with the same
        key waits for its retry or is leased by another relay, so a key's rows leave in
        order. Returns the records sorted by id.
        """
        table = self.table
        now = utcnow()
        candidate = table.alias("candidate")
        earlier = table.alias("earlier")
        blocked = exists().where(
            earlier.c.message_key == candidate.c.message_key,
            earlier.c.state == PENDING,
            earlier.c.id < candidate.c.id,
            or_(
                and_(earlier.c.attempts > 0, earlier.c.available_at > now),
                and_(earlier.c.locked_until >= now, earlier.c.locked_by != relay_id),
            ),
        )
        conditions: list[ColumnElement[bool]] = [
            candidate.c.state == PENDING,
            candidate.c.available_at <= now,
            or_(candidate.c.locked_until.is_(None), candidate.c.locked_until < now),
            candidate.c.broker.in_(sorted(brokers)),
            ~blocked,
        ]
        if shard_filter is not None:
            conditions.append(_owned_shards(candidate.c.shard_hash, shard_filter))
        candidates = select(candidate.c.id).where(*conditions).order_by(candidate.c.id).limit(limit)
        if engine.dialect.name == "postgresql":
            candidates = candidates.with_for_update(skip_locked=True, of=candidate)
        statement = (
            update(table)
            .where(table.c.id.in_(candidates))
            .values(locked_by=relay_id, locked_until=now + lease)
            .returning(
                table.c.id,
                table.c.message_id,
                table.c.broker,
                table.c.destination,
                table.c.routing_key,
                table.c.message_key,
                table.c.headers,
                table.c.properties,
                table.c.payload,
                table.c.attempts,
                table.c.created_at,
            )
        )
        with engine.begin() as connection:
            rows = connection.execute(statement).all()
        records = [
            OutboxRecord(
                id=row.id,
                message_id=row.message_id,
                broker=row.broker,
                destination=row.destination,
                routing_key=row.routing_key,
                key=row.message_key,
                headers=row.headers,
                properties=row.properties,
                payload=row.payload,
                attempts=row.attempts,
                created_at=row.created_at,
            )
            for row in rows
        ]
        records.sort(key=lambda record: record.id)
        return records

    def mark_published(self, engine: Engine, ids: Sequence[int], *, delete_rows: bool) -> None:
        """Mark rows published (or delete them) in one statement."""
        if not ids:
            return
        table = self.table
        statement: Any
        if delete_rows:
            statement = delete(table).where(table.c.id.in_(list(ids)))
        else:
            statement = (
                update(table)
                .where(table.c.id.in_(list(ids)))
                .values(state=PUBLISHED, published_at=utcnow(), locked_by=None, locked_until=None)
            )
        with engine.begin() as connection:
            connection.execute(statement)

    def release(self, engine: Engine, ids: Sequence[int], relay_id: str) -> None:
        """Give leased rows back unchanged (the broker was unavailable)."""
        if not ids:
            return
        table = self.table
        with engine.begin() as connection:
            connection.execute(
                update(table)
                .where(table.c.id.in_(list(ids)), table.c.locked_by == relay_id)
                .values(locked_by=None, locked_until=None)
            )

    def record_failures(
        self,
        engine: Engine,
        failures: Sequence[tuple[OutboxRecord, str]],
        max_attempts: int,
        backoff: Callable[[int], float],
    ) -> list[OutboxRecord]:
        """Count one failed attempt per row: retry later with backoff, or mark failed.

        Returns the records that reached ``max_attempts`` and are now ``failed`` (they
        stay in the table until :meth:`retry_failed` or an operator removes them).
        """
        if not failures:
            return []
        table = self.table
        now = utcnow()
        params = []
        failed: list[OutboxRecord] = []
        for record, error in failures:
            attempts = record.attempts + 1
            gave_up = attempts >= max_attempts
            if gave_up:
                failed.append(record)
            params.append(
                {
                    "b_id": record.id,
                    "b_attempts": attempts,
                    "b_state": FAILED if gave_up else PENDING,
                    "b_error": error[:MAX_ERROR_LENGTH],
                    "b_available": now + timedelta(seconds=0 if gave_up else backoff(attempts)),
                }
            )
        statement = (
            update(table)
            .where(table.c.id == bindparam("b_id"))
            .values(
                attempts=bindparam("b_attempts"),
                state=bindparam("b_state"),
                last_error=bindparam("b_error"),
                available_at=bindparam("b_available"),
                locked_by=None,
                locked_until=None,
            )
        )
        with engine.begin() as connection:
            connection.execute(statement, params)
        return failed

    # -- operators ---------------------------------------------------------------------------

    def retry_failed(
        self,
        engine: Engine,
        *,
        ids: Sequence[int] | None = None,
        broker: str | None = None,
        destination: str | None = None,
    ) -> int:
        """Put failed rows back to pending with fresh attempts; return how many.

        ``ids`` / ``broker`` / ``destination`` narrow the selection. The relay is woken
        on PostgreSQL.
        """
        table = self.table
        conditions: list[ColumnElement[bool]] = [table.c.state == FAILED]
        if ids is not None:
            conditions.append(table.c.id.in_(list(ids)))
        if broker is not None:
            conditions.append(table.c.broker == broker)
        if destination is not None:
            conditions.append(table.c.destination == destination)
        with engine.begin() as connection:
            result = connection.execute(
                update(table)
                .where(*conditions)
                .values(
                    state=PENDING,
                    attempts=0,
                    available_at=utcnow(),
                    locked_by=None,
                    locked_until=None,
                )
            )
            count = result.rowcount
            if count and engine.dialect.name == "postgresql":
                self._notify(connection)
        log.info("failed outbox rows put back", extra={"rows": count, "table": table.name})
        return count

    def purge(self, engine: Engine, older_than: timedelta, chunk_size: int = 5000) -> int:
        """Delete published rows older than ``older_than``, ``chunk_size`` rows per
        transaction; pending and failed rows are never touched. Returns rows deleted."""
        table = self.table
        cutoff = utcnow() - older_than
        chunk = table.alias("chunk")
        oldest = (
            select(chunk.c.id)
            .where(chunk.c.state == PUBLISHED, chunk.c.published_at < cutoff)
            .order_by(chunk.c.published_at)
            .limit(chunk_size)
        )
        statement = delete(table).where(table.c.id.in_(oldest))
        total = 0
        while True:
            with engine.begin() as connection:
                deleted = connection.execute(statement).rowcount
            total += deleted
            if deleted < chunk_size:
                break
        if total:
            log.info(
                "purged published outbox rows",
                extra={"deleted": total, "cutoff": cutoff.isoformat(), "table": table.name},
            )
        return total

    def status(self, engine: Engine) -> OutboxStatus:
        """Counts of pending / failed / published rows, per destination too."""
        table = self.table
        now = utcnow()
        due_since = func.min(
            case(
                (and_(table.c.state == PENDING, table.c.available_at <= now), table.c.available_at)
            )
        )
        statement = select(
            table.c.broker, table.c.destination, table.c.state, func.count(), due_since
        ).group_by(table.c.broker, table.c.destination, table.c.state)
        with engine.connect() as connection:
            rows = connection.execute(statement).all()
        per_destination: dict[tuple[str, str], dict[str, Any]] = {}
        for broker, destination, state, count, oldest in rows:
            entry = per_destination.setdefault(
                (broker, destination),
                {"broker": broker, "destination": destination, "oldest_pending_age": None},
            )
            entry[state] = entry.get(state, 0) + int(count)
            if oldest is not None:
                entry["oldest_pending_age"] = _age(now, oldest)
        destinations = [
            DestinationStatus(**{k: v for k, v in entry.items() if k != "state"})
            for _, entry in sorted(per_destination.items())
        ]
        ages = [d.oldest_pending_age for d in destinations if d.oldest_pending_age is not None]
        return OutboxStatus(
            pending=sum(d.pending for d in destinations),
            failed=sum(d.failed for d in destinations),
            published=sum(d.published for d in destinations),
            oldest_pending_age=max(ages) if ages else None,
            destinations=destinations,
        )

    def _notify(self, connection: Connection) -> None:
        connection.execute(text("SELECT pg_notify(:channel, '')"), {"channel": self.channel})


def _owned_shards(shard_hash: Any, owner: ShardFilter) -> ColumnElement[bool]:
    """``shard_hash % shards`` is one of the shards whose advisory lock ``owner`` holds."""
    owned = text(
        "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid = CAST(:lock_class AS oid) AND objsubid = 2 AND pid = :owner_pid AND granted"
    ).bindparams(lock_class=owner.lock_class, owner_pid=owner.backend_pid)
    shard: ColumnElement[int] = shard_hash % owner.shards
    return shard.in_(owned.columns(objid=BigInteger))


def _age(now: datetime, then: datetime) -> float:
    if then.tzinfo is None:  # SQLite returns naive UTC timestamps
        then = then.replace(tzinfo=UTC)
    return max(0.0, (now - then).total_seconds())
