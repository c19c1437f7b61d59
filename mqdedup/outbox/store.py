"""The outbox table's statements: claim, mark, retry, purge and status.

Every method runs its own short transaction: on the engine, or as one autocommit
statement on a relay connection (:func:`~mqdedup.db.dialects.prepare_relay_connection`).
The writer, which runs in the caller's transaction, lives in :mod:`mqdedup.outbox.writer`.
What differs between databases (session settings, the id-list clause, lock checks,
capabilities) is in :mod:`mqdedup.db.dialects`. Rows are claimed *by state* (``pending``,
due, not leased), never by "id greater than the last one seen": a row whose transaction
commits late is still found.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Dialect,
    Engine,
    Integer,
    Text,
    and_,
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

from mqdedup.db.dialects import (
    ADVISORY_LOCKS_HELD,
    CLAIM_SETTINGS,
    MARK_SETTINGS,
    ids_clause,
    ids_params,
    named_locks_held,
    relay_transaction,
    traits,
)
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import utcnow
from mqdedup.outbox.notify import channel_name
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.outbox.writer import FAILED, PENDING, PUBLISHED

log = logging.getLogger(__name__)

MAX_ERROR_LENGTH = 2000
Bind = Engine | Connection

class _ShardsLostError(Exception):
    """The relay's control connection no longer holds a shard it claims from."""


def _record_id(record: OutboxRecord) -> int:
    return record.id


@dataclass(frozen=True)
class ShardFilter:
    """Restricts a claim to the shards ``owned`` through locks held by one connection.

    PostgreSQL: advisory locks of ``lock_class`` held by the backend ``backend_pid``; the
    claim re-checks them in ``pg_locks`` in the same statement. MySQL/MariaDB: the named
    locks ``lock_names`` held by the connection id ``backend_pid``; the claim re-checks
    them with ``IS_USED_LOCK`` in its transaction. Either way a relay whose lock
    connection died (and whose shards another relay may have taken) claims nothing.
    """

    shards: int
    owned: frozenset[int]
    lock_class: int
    backend_pid: int
    lock_names: tuple[str, ...] = ()


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

        PostgreSQL: one statement, its own short transaction: ``WITH chosen AS (SELECT id
        … ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED) UPDATE … SET locked_by, locked_until
        FROM chosen RETURNING …``. MySQL/MariaDB: the same selection in one short
        transaction of a few statements (see :meth:`_claim_mysql`). A row is skipped while
        an earlier row with the same key waits for its retry, so a key's rows leave in
        order. ``bind`` is an engine or a connection prepared with
        :func:`~mqdedup.db.dialects.prepare_relay_connection`. Returns the records sorted
        by id.
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
        if not traits(bind).claim_in_one_statement:
            return self._claim_mysql(bind, params, shard_filter)
        statement = self._claim_statement(shard_filter is not None)
        with relay_transaction(bind, CLAIM_SETTINGS) as connection:
            rows = connection.execute(statement, params).all()
        return _records(rows)

    def _claim_mysql(
        self, bind: Bind, params: dict[str, Any], shard_filter: ShardFilter | None
    ) -> list[OutboxRecord]:
        """The claim on MySQL/MariaDB, which have no ``UPDATE … RETURNING``.

        One short ``READ COMMITTED`` transaction:

        1. ``SELECT id … ORDER BY id LIMIT n``, the same conditions as on PostgreSQL, as
           a plain (non-locking) read of the latest committed rows;
        2. ``UPDATE … SET locked_by, locked_until WHERE id IN (…)``, re-checking that each
           row is still pending and not leased (the row lock decides between two
           claimers: the second sees the first's lease and leaves the row);
        3. check that the relay still holds its shards' named locks (else roll back);
        4. read the rows this relay leased; commit.

        No ``FOR UPDATE SKIP LOCKED`` here: InnoDB locks every row its locking read
        *examines*, so another relay scanning past this relay's rows (of its own shards)
        would make them skipped, and a key's later row could leave before an earlier
        one. Shards (named locks) keep relays apart; the conditional ``UPDATE`` keeps
        a row from being leased twice.
        """
        table = self.table
        try:
            with relay_transaction(bind, CLAIM_SETTINGS) as connection:
                ids = list(
                    connection.execute(self._claim_ids_mysql(shard_filter is not None), params)
                    .scalars()
                    .all()
                )
                if not ids:
                    return []
                now = params["now"]
                connection.execute(
                    update(table)
                    .where(
                        table.c.id.in_(ids),
                        table.c.state == PENDING,
                        or_(table.c.locked_until.is_(None), table.c.locked_until < now),
                    )
                    .values(locked_by=params["relay_id"], locked_until=params["until"])
                )
                if shard_filter is not None and not named_locks_held(
                    connection, shard_filter.lock_names, shard_filter.backend_pid
                ):
                    raise _ShardsLostError
                rows = connection.execute(
                    self._claimed_rows().where(
                        table.c.id.in_(ids),
                        table.c.locked_by == params["relay_id"],
                        table.c.locked_until == params["until"],
                    )
                ).all()
        except _ShardsLostError:  # the transaction was rolled back: nothing leased
            log.warning("relay lost its shard locks; claiming nothing", extra={"table": table.name})
            return []
        return _records(rows)

    @functools.cache  # noqa: B019 - two statements per store, built once
    def _claim_ids_mysql(self, sharded: bool) -> Any:
        """``SELECT id … ORDER BY id LIMIT n``: the claimable rows, oldest first."""
        candidate, conditions = self._claimable(sharded, pg_locks=False)
        return (
            select(candidate.c.id)
            .where(*conditions)
            .order_by(candidate.c.id)
            .limit(bindparam("limit", type_=Integer))
        )

    def _claimed_rows(self) -> Any:
        return select(*self._claimed_columns())

    def _claimed_columns(self) -> tuple[Any, ...]:
        """What a claim returns, in the order :func:`_records` reads it."""
        table = self.table
        return (
            table.c.id,
            table.c.message_id,
            table.c.broker,
            table.c.destination,
            table.c.routing_key,
            table.c.message_key,
            # JSON as text, decoded by _records: much cheaper than the driver's JSON loader.
            cast(table.c.headers, Text),
            cast(table.c.properties, Text),
            table.c.payload,
            table.c.attempts,
            table.c.created_at,
        )

    def _claimable(
        self, sharded: bool, *, pg_locks: bool = True
    ) -> tuple[Any, list[ColumnElement[bool]]]:
        """The ``candidate`` alias and the conditions that make one of its rows claimable."""
        table = self.table
        now = bindparam("now", type_=table.c.available_at.type)
        candidate = table.alias("candidate")
        earlier = table.alias("earlier")
        # An earlier row of the same key waiting for its retry holds this one back
        # (matches the small partial index <prefix>outbox_retrying_idx; on MySQL/MariaDB
        # <prefix>outbox_key_state_idx).
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
            conditions.extend(_owned_shards(candidate.c.shard_hash, pg_locks=pg_locks))
        return candidate, conditions

    @functools.cache  # noqa: B019 - two statements per store, built once
    def _claim_statement(self, sharded: bool) -> Any:
        """The claim statement (see :meth:`claim`), with bind parameters for the values."""
        table = self.table
        candidate, conditions = self._claimable(sharded)
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
            .returning(*self._claimed_columns())
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
        statement = self._mark_statement(delete_rows, bind.dialect)
        with relay_transaction(bind, MARK_SETTINGS) as connection:
            connection.execute(statement, {**ids_params(ids), "now": utcnow()})

    @functools.cache  # noqa: B019 - four statements per store, built once
    def _mark_statement(self, delete_rows: bool, dialect: Dialect) -> Any:
        table = self.table
        selected = ids_clause(table.c.id, dialect)
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
        selected = ids_clause(table.c.id, bind.dialect)
        with relay_transaction(bind, MARK_SETTINGS) as connection:
            connection.execute(
                update(table)
                .where(selected, table.c.locked_by == relay_id)
                .values(locked_by=None, locked_until=None),
                ids_params(ids),
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
            if count and traits(engine).notifies:
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
        read_ids_first = not traits(engine).limit_in_subquery
        total = 0
        while True:
            with engine.begin() as connection:
                if read_ids_first:  # no LIMIT in an IN subquery (MySQL): read the chunk first
                    ids = list(connection.execute(oldest).scalars())
                    deleted = (
                        connection.execute(delete(table).where(table.c.id.in_(ids))).rowcount
                        if ids
                        else 0
                    )
                else:
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


def _records(rows: Sequence[Any]) -> list[OutboxRecord]:
    """Claimed rows (columns as in the claim's ``RETURNING``) as records sorted by id."""
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
            _aware(row[10]),
        )
        for row in rows
    ]
    records.sort(key=_record_id)
    return records


def _aware(moment: datetime) -> datetime:
    """A timestamp read back from the database, in UTC (MySQL and SQLite return naive)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def _owned_shards(shard_hash: Any, *, pg_locks: bool = True) -> list[ColumnElement[bool]]:
    """The row's shard is one the relay owns, and (PostgreSQL) it still holds all of them.

    The second condition is an uncorrelated subquery on ``pg_locks`` (evaluated once per
    claim): if the relay's lock connection died, its shards may belong to another relay
    by now, and the claim returns nothing. MySQL/MariaDB check their named locks with a
    separate statement in the claim's transaction
    (:func:`~mqdedup.db.dialects.named_locks_held`).
    """
    shard: ColumnElement[int] = shard_hash % bindparam("shards", type_=Integer)
    owned: ColumnElement[bool] = shard.in_(bindparam("owned_shards", expanding=True))
    if not pg_locks:
        return [owned]
    return [owned, ADVISORY_LOCKS_HELD]  # type: ignore[list-item]


def _age(now: datetime, then: datetime) -> float:
    if then.tzinfo is None:  # SQLite returns naive UTC timestamps
        then = then.replace(tzinfo=UTC)
    return max(0.0, (now - then).total_seconds())
