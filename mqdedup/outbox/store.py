"""The outbox table's statements: claim, mark, retry, purge and status.

Every method runs its own short transaction: on the engine, or as one autocommit
statement on a relay connection (:func:`prepare_relay_connection`). The writer, which
runs in the caller's transaction, lives in :mod:`mqdedup.outbox.writer`. Rows are claimed *by
state* (``pending``, due, not leased), never by "id greater than the last one seen":
a row whose transaction commits late is still found.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    Engine,
    Integer,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    literal,
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
Bind = Engine | Connection

# PostgreSQL settings of the relay's statements. The planner settings keep the claim on
# the pending index in id order, stopping at the limit, and the update on the primary
# key, even when the statistics still describe an almost empty table (a fresh backlog).
# Leases and marks need no synchronous commit: one lost in a database crash only means a
# row is published again, which the at-least-once contract allows anyway.
_PLANNER = ("enable_sort", "enable_bitmapscan", "enable_hashjoin", "enable_mergejoin")
RELAY_SESSION_SETTINGS = [f"SET {name} = off" for name in _PLANNER] + [
    "SET synchronous_commit = off"
]
_CLAIM_SETTINGS = text(
    "; ".join(setting.replace("SET ", "SET LOCAL ") for setting in RELAY_SESSION_SETTINGS)
)
_MARK_SETTINGS = text("SET LOCAL synchronous_commit = off")


def prepare_relay_connection(connection: Connection) -> Connection:
    """Make ``connection`` a relay connection: autocommit (each statement is its own
    short transaction, one round trip) with the relay's session settings (PostgreSQL).

    Detach the connection from the pool afterwards (the settings stay on it).
    """
    connection = connection.execution_options(isolation_level="AUTOCOMMIT")
    for setting in RELAY_SESSION_SETTINGS:
        connection.exec_driver_sql(setting)
    return connection


@contextmanager
def _transaction(bind: Bind, settings: Any) -> Iterator[Connection]:
    """A short transaction on an engine, or the statement's own on a relay connection."""
    if isinstance(bind, Connection):
        yield bind
        return
    with bind.begin() as connection:
        if bind.dialect.name == "postgresql":
            connection.execute(settings)
        yield connection


def _record_id(record: OutboxRecord) -> int:
    return record.id


@dataclass(frozen=True)
class ShardFilter:
    """Restricts a claim to the shards ``owned`` through advisory locks by a backend.

    The claim re-checks the owner's locks in ``pg_locks`` in the same statement, so a
    relay whose lock connection died (and whose shards another relay may have taken)
    claims nothing.
    """

    shards: int
    owned: frozenset[int]
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
        bind: Bind,
        relay_id: str,
        limit: int,
        lease: timedelta,
        *,
        brokers: Collection[str],
        shard_filter: ShardFilter | None = None,
    ) -> list[OutboxRecord]:
        """Lease up to ``limit`` due pending rows for ``brokers``, oldest id first.

        One statement, its own short transaction: ``WITH chosen AS (SELECT id … ORDER BY
        id LIMIT n FOR UPDATE SKIP LOCKED) UPDATE … SET locked_by, locked_until FROM chosen
        RETURNING …``. A row is skipped while an earlier row with the same key waits for
        its retry, so a key's rows leave in order. ``bind`` is an engine or a connection
        prepared with :func:`prepare_relay_connection` (autocommit, planner settings).
        Returns the records sorted by id.
        """
        now = utcnow()
        params: dict[str, Any] = {
            "now": now,
            "until": now + lease,
            "relay_id": relay_id,
            "limit": limit,
            "brokers": sorted(brokers),
        }
        if shard_filter is not None:
            params.update(
                shards=shard_filter.shards,
                owned_shards=sorted(shard_filter.owned),
                owned=sorted(shard_filter.owned),
                owned_count=len(shard_filter.owned),
                lock_class=shard_filter.lock_class,
                owner_pid=shard_filter.backend_pid,
            )
        statement = self._claim_statement(shard_filter is not None)
        with _transaction(bind, _CLAIM_SETTINGS) as connection:
            rows = connection.execute(statement, params).all()
        loads = json.loads
        records = [
            OutboxRecord(
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                row[5],
                loads(row[6]),
                None if row[7] is None else loads(row[7]),
                row[8],
                row[9],
                row[10],
            )
            for row in rows
        ]
        records.sort(key=_record_id)
        return records

    @functools.cache  # noqa: B019 - two statements per store, built once
    def _claim_statement(self, sharded: bool) -> Any:
        """The claim statement (see :meth:`claim`), with bind parameters for the values."""
        table = self.table
        now = bindparam("now", type_=table.c.available_at.type)
        candidate = table.alias("candidate")
        earlier = table.alias("earlier")
        # An earlier row of the same key waiting for its retry holds this one back
        # (matches the small partial index <prefix>outbox_retrying_idx).
        blocked = exists().where(
            earlier.c.message_key == candidate.c.message_key,
            earlier.c.id < candidate.c.id,
            earlier.c.state == PENDING,
            earlier.c.attempts > 0,
            earlier.c.available_at > now,
        )
        conditions: list[ColumnElement[bool]] = [
            candidate.c.state == PENDING,
            candidate.c.available_at <= now,
            or_(candidate.c.locked_until.is_(None), candidate.c.locked_until < now),
            candidate.c.broker.in_(bindparam("brokers", expanding=True)),
            ~blocked,
        ]
        if sharded:
            conditions.extend(_owned_shards(candidate.c.shard_hash))
        chosen = (
            select(candidate.c.id)
            .where(*conditions)
            .order_by(candidate.c.id)
            .limit(bindparam("limit", type_=Integer))
            .with_for_update(skip_locked=True, of=candidate)
            .cte("chosen")
        )
        return (
            update(table)
            .where(table.c.id == chosen.c.id)
            .values(
                locked_by=bindparam("relay_id", type_=table.c.locked_by.type),
                locked_until=bindparam("until", type_=table.c.locked_until.type),
            )
            .returning(
                table.c.id,
                table.c.message_id,
                table.c.broker,
                table.c.destination,
                table.c.routing_key,
                table.c.message_key,
                # JSON as text, decoded below: much cheaper than the driver's JSON loader.
                cast(table.c.headers, Text),
                cast(table.c.properties, Text),
                table.c.payload,
                table.c.attempts,
                table.c.created_at,
            )
        )

    def foreign_leases(self, engine: Engine, relay_id: str, shards: int | None = None) -> set[int]:
        """Shards (``shard_hash % shards``; ``{0}`` without sharding) holding pending rows
        leased by another relay whose lease has not expired.

        A relay that takes over shards waits until this is empty for them: the rows of a
        crashed relay come back in order, before later rows of their keys.
        """
        table = self.table
        now = utcnow()
        shard: Any = (table.c.shard_hash % shards) if shards else literal(0)
        query = (
            select(shard)
            .where(
                table.c.state == PENDING,
                table.c.locked_until >= now,
                table.c.locked_by != relay_id,
            )
            .distinct()
        )
        with engine.connect() as connection:
            return {int(value) for value in connection.execute(query).scalars()}

    def mark_published(self, bind: Bind, ids: Sequence[int], *, delete_rows: bool) -> None:
        """Mark rows published (or delete them) in one statement."""
        if not ids:
            return
        statement = self._mark_statement(delete_rows, bind.dialect.name == "postgresql")
        with _transaction(bind, _MARK_SETTINGS) as connection:
            connection.execute(statement, {**_ids_params(ids), "now": utcnow()})

    @functools.cache  # noqa: B019 - four statements per store, built once
    def _mark_statement(self, delete_rows: bool, postgresql: bool) -> Any:
        table = self.table
        selected = _ids_clause(table.c.id, postgresql)
        if delete_rows:
            return delete(table).where(selected)
        return (
            update(table)
            .where(selected)
            .values(
                state=PUBLISHED,
                published_at=bindparam("now", type_=table.c.published_at.type),
                locked_by=None,
                locked_until=None,
            )
        )

    def release(self, bind: Bind, ids: Sequence[int], relay_id: str) -> None:
        """Give leased rows back unchanged (the broker was unavailable)."""
        if not ids:
            return
        table = self.table
        selected = _ids_clause(table.c.id, bind.dialect.name == "postgresql")
        with _transaction(bind, _MARK_SETTINGS) as connection:
            connection.execute(
                update(table)
                .where(selected, table.c.locked_by == relay_id)
                .values(locked_by=None, locked_until=None),
                _ids_params(ids),
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


def _owned_shards(shard_hash: Any) -> list[ColumnElement[bool]]:
    """The row's shard is one the relay owns, and the relay still holds all of them.

    The second condition is an uncorrelated subquery on ``pg_locks`` (evaluated once per
    claim): if the relay's lock connection died, its shards may belong to another relay
    by now, and the claim returns nothing.
    """
    still_held = text(
        "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid = CAST(:lock_class AS oid) AND objsubid = 2 AND pid = :owner_pid "
        "AND granted AND objid::bigint = ANY(CAST(:owned AS bigint[]))) = :owned_count"
    )
    shard: ColumnElement[int] = shard_hash % bindparam("shards", type_=Integer)
    owned: ColumnElement[bool] = shard.in_(bindparam("owned_shards", expanding=True))
    return [owned, still_held]  # type: ignore[list-item]


def _ids_clause(column: Any, postgresql: bool) -> ColumnElement[bool]:
    """``column`` is one of the ``ids`` parameter (see :func:`_ids_params`).

    PostgreSQL: ``= ANY(:ids)`` with one array parameter, plus the ids' range, which lets
    the planner walk the primary key instead of scanning the table (it underestimates
    what ``= ANY(array)`` selects). Elsewhere: ``IN (…)``.
    """
    if postgresql:
        array = bindparam("ids", type_=ARRAY(BigInteger))
        clause: ColumnElement[bool] = and_(
            column.between(bindparam("low", type_=BigInteger), bindparam("high", type_=BigInteger)),
            column == any_(array),
        )
        return clause
    membership: ColumnElement[bool] = column.in_(bindparam("ids", expanding=True))
    return membership


def _ids_params(ids: Sequence[int]) -> dict[str, Any]:
    return {"ids": list(ids), "low": min(ids), "high": max(ids)}


def _age(now: datetime, then: datetime) -> float:
    if then.tzinfo is None:  # SQLite returns naive UTC timestamps
        then = then.replace(tzinfo=UTC)
    return max(0.0, (now - then).total_seconds())
