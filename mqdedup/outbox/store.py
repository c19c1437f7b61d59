"""The outbox table's statements: claim, mark, retry, purge and status.

Every method runs its own short transaction: on the engine, or as one autocommit
statement on a relay connection (:func:`~mqdedup.db.dialects.prepare_relay_connection`).
The writer, which runs in the caller's transaction, lives in :mod:`mqdedup.outbox.writer`.
What differs between databases (session settings, the id-list clause, lock checks,
capabilities) is in :mod:`mqdedup.db.dialects`. Rows are claimed *by state* (``pending``,
due, not in the relay's own batches in flight), never by "id greater than the last one
seen": a row whose transaction commits late is still found. The relay's lease is one row
per relay in ``<prefix>outbox_leases``; delete-marked rows are counted per destination
and hour in ``<prefix>outbox_counts``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    Dialect,
    Engine,
    Integer,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
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
from mqdedup.dedup.store import aware, utcnow
from mqdedup.outbox.notify import channel_name
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.outbox.writer import FAILED, PENDING, PUBLISHED

log = logging.getLogger(__name__)

MAX_ERROR_LENGTH = 2000
#: The most shards an outbox table can be spread over.
MAX_LEASE_SHARDS = 4096
#: The lease ``shards`` of a relay taking turns (``coordination = transaction``): all.
EVERY_SHARD = "*"
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
        tables = schema(prefix)
        self.table = tables.outbox
        self.leases = tables.outbox_leases
        self.counts = tables.outbox_counts
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
        in_flight: Sequence[int] = (),
    ) -> list[OutboxRecord]:
        """Up to ``limit`` due pending rows for ``brokers`` with ids above ``after``,
        oldest id first, under one lease for the whole batch.

        The rows are only read (no row is written or locked); the lease is this relay's
        row in ``<prefix>outbox_leases`` (its shards, until ``now + lease``), written in
        the same transaction when rows were found. It keeps a relay that takes over those
        shards waiting (:meth:`foreign_leases`) until this relay removed it
        (:meth:`end_lease`, once its batches are settled) or it expired (the relay died).
        ``in_flight``: ids of this relay's batches still being published or marked, which
        a claim made ahead skips (rows are claimed by state, never by "id greater than
        the last one": a row whose transaction commits late is still found, before later
        rows of its key). PostgreSQL: one statement (the lease written by a CTE); MySQL/MariaDB
        and SQLite: a short transaction of two or three statements (see
        :meth:`_claim_in_steps`). A row is skipped while an earlier row with the same key
        waits for its retry, so a key's rows leave in order. ``bind`` is an engine or a
        connection prepared with :func:`~mqdedup.db.dialects.prepare_relay_connection`.
        Returns the records sorted by id.
        """
        params = _claim_params(relay_id, limit, lease, brokers, list(in_flight))
        if shard_filter is not None:
            params.update(
                shards=shard_filter.shards,
                owned_shards=sorted(shard_filter.owned),
                owned=sorted(shard_filter.owned),
                owned_count=len(shard_filter.owned),
                lock_class=shard_filter.lock_class,
                owner_pid=shard_filter.backend_pid,
                lease_shards=",".join(str(shard) for shard in sorted(shard_filter.owned)),
            )
        if not traits(bind).claim_in_one_statement:
            return self._claim_in_steps(bind, params, shard_filter)
        params["in_flight"] = _array_literal(in_flight)
        statement = self._claim_statement(shard_filter is not None)
        with relay_transaction(bind, CLAIM_SETTINGS) as connection:
            rows = connection.execute(statement, params).all()
        return _records(rows)

    def claim_in_turn(
        self,
        engine: Engine,
        relay_id: str,
        limit: int,
        lease: timedelta,
        *,
        brokers: Collection[str],
        lock_class: int,
        in_flight: Sequence[int] = (),
    ) -> list[OutboxRecord] | None:
        """The claim of relays that take turns (PostgreSQL, no session state needed).

        For a database reached through a transaction pooler, where session advisory
        locks cannot hold. One transaction: a transaction-level advisory lock
        (``pg_advisory_xact_lock``, ``lock_class``, key 0) serialises the claims of every
        turn-taking relay of the table; the same class's key 1, which every relay
        coordinating through session locks holds shared for its life, is try-locked
        exclusively: while one runs this claims nothing and returns ``None`` (session
        relays own the table; they wait for this claim's lease). Then, in a fresh
        snapshot, nothing is claimed while another relay's lease is live (it has rows
        published or being published and not yet marked); else the rows are claimed as
        by :meth:`claim` (unsharded) under a lease on every shard (``*``). So one relay
        publishes at a time and a key's rows leave in id order; a relay that died holds
        the others off until its lease expires.
        """
        params = _claim_params(relay_id, limit, lease, brokers, _array_literal(in_flight))
        params["lease_shards"] = EVERY_SHARD
        leases = self.leases
        live = select(
            func.pg_try_advisory_xact_lock(
                cast(bindparam("c", lock_class), Integer), cast(literal(1), Integer)
            ),
            select(func.count())
            .where(leases.c.relay_id != relay_id, leases.c.locked_until >= params["now"])
            .scalar_subquery(),
        )
        with relay_transaction(engine, CLAIM_SETTINGS) as connection:
            connection.execute(
                text("SELECT pg_advisory_xact_lock(CAST(:c AS int), 0)"), {"c": lock_class}
            )
            alone, others = connection.execute(live).one()
            if not alone:
                return None
            if others:
                return []
            rows = connection.execute(self._claim_statement(False), params).all()
        return _records(rows)

    def _claim_in_steps(
        self, bind: Bind, params: dict[str, Any], shard_filter: ShardFilter | None
    ) -> list[OutboxRecord]:
        """The claim on MySQL/MariaDB and SQLite: one short transaction that

        1. reads the claimable rows (``… ORDER BY id LIMIT n``, the same conditions as on
           PostgreSQL) as a plain, non-locking read of the latest committed rows;
        2. (MySQL/MariaDB, sharded) checks that the relay still holds its shards' named
           locks, else claims nothing;
        3. writes the relay's lease row; commits.

        No locking read: shards (named locks) keep relays apart, and InnoDB would lock
        every row a locking read *examines*, so another relay scanning past this relay's
        rows would make them skipped.
        """
        try:
            with relay_transaction(bind, CLAIM_SETTINGS) as connection:
                rows = connection.execute(self._claim_read(shard_filter is not None), params).all()
                if not rows:
                    return []
                if shard_filter is not None and not named_locks_held(
                    connection, shard_filter.lock_names, shard_filter.backend_pid
                ):
                    raise _ShardsLostError
                connection.execute(self._lease_upsert(connection.dialect), params)
        except _ShardsLostError:  # the transaction was rolled back: no lease taken
            log.warning(
                "relay lost its shard locks; claiming nothing", extra={"table": self.table.name}
            )
            return []
        return _records(rows)

    @functools.cache  # noqa: B019 - two statements per store, built once
    def _claim_read(self, sharded: bool) -> Any:
        """``SELECT … ORDER BY id LIMIT n``: the claimable rows, oldest first."""
        candidate, conditions = self._claimable(sharded, pg_locks=False)
        return (
            select(*self._claimed_columns(candidate))
            .where(*conditions)
            .order_by(candidate.c.id)
            .limit(bindparam("limit", type_=Integer))
        )

    @functools.cache  # noqa: B019 - one statement per dialect, built once
    def _lease_upsert(self, dialect: Dialect) -> Any:
        """Insert or renew this relay's lease row (``relay_id``, ``lease_shards``, ``until``)."""
        leases = self.leases
        values = {
            "relay_id": bindparam("relay_id", type_=leases.c.relay_id.type),
            "shards": bindparam("lease_shards", type_=leases.c.shards.type),
            "locked_until": bindparam("until", type_=leases.c.locked_until.type),
        }
        if traits(dialect).family == "mysql":
            statement = mysql_insert(leases).values(values)
            return statement.on_duplicate_key_update(
                shards=statement.inserted.shards, locked_until=statement.inserted.locked_until
            )
        upsert = (postgresql_insert if dialect.name == "postgresql" else sqlite_insert)(leases)
        upsert = upsert.values(values)
        return upsert.on_conflict_do_update(
            index_elements=[leases.c.relay_id],
            set_={"shards": upsert.excluded.shards, "locked_until": upsert.excluded.locked_until},
        )

    def _claimed_columns(self, table: Any) -> tuple[Any, ...]:
        """What a claim returns, in the order :func:`_records` reads it."""
        return (
            table.c.id,
            table.c.message_id,
            table.c.broker,
            table.c.destination,
            table.c.routing_key,
            table.c.message_key,
            # JSON as text, decoded by _records: much cheaper than the driver's JSON loader.
            cast(table.c.headers, Text).label("headers"),
            cast(table.c.properties, Text).label("properties"),
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
            _not_in_flight(candidate.c.id, pg_locks),
            candidate.c.available_at <= now,
            candidate.c.broker.in_(bindparam("brokers", expanding=True)),
            ~blocked,
        ]
        if sharded:
            conditions.extend(_owned_shards(candidate.c.shard_hash, pg_locks=pg_locks))
        return candidate, conditions

    @functools.cache  # noqa: B019 - two statements per store, built once
    def _claim_statement(self, sharded: bool) -> Any:
        """The PostgreSQL claim (see :meth:`claim`): ``WITH chosen AS (SELECT … ORDER BY
        id LIMIT n), lease AS (INSERT … ON CONFLICT DO UPDATE … WHERE EXISTS chosen)
        SELECT * FROM chosen``, with bind parameters for the values."""
        candidate, conditions = self._claimable(sharded)
        chosen = (
            select(*self._claimed_columns(candidate))
            .where(*conditions)
            .order_by(candidate.c.id)
            .limit(bindparam("limit", type_=Integer))
            .cte("chosen")
        )
        leases = self.leases
        lease = postgresql_insert(leases).from_select(
            ["relay_id", "shards", "locked_until"],
            select(
                bindparam("relay_id", type_=leases.c.relay_id.type),
                bindparam("lease_shards", type_=leases.c.shards.type),
                bindparam("until", type_=leases.c.locked_until.type),
            ).where(exists(select(literal(1)).select_from(chosen))),
        )
        lease = lease.on_conflict_do_update(
            index_elements=[leases.c.relay_id],
            set_={"shards": lease.excluded.shards, "locked_until": lease.excluded.locked_until},
        )
        return select(chosen).add_cte(lease.cte("lease"))

    def foreign_leases(self, engine: Engine, relay_id: str) -> set[int]:
        """Shards (``{0}`` without sharding) under another relay's lease that has not
        expired.

        A relay that takes over shards waits until this is empty for them: the rows of a
        crashed relay come back in order, before later rows of their keys.
        """
        leases = self.leases
        query = select(leases.c.shards).where(
            leases.c.relay_id != relay_id, leases.c.locked_until >= utcnow()
        )
        with engine.connect() as connection:
            listed = connection.execute(query).scalars().all()
        if EVERY_SHARD in listed:  # a relay taking turns (coordination transaction)
            return set(range(MAX_LEASE_SHARDS))
        return {int(shard) for text_ in listed for shard in text_.split(",") if shard}

    def end_lease(self, bind: Bind, relay_id: str) -> None:
        """Remove this relay's lease (its batches are settled; its shards may move)."""
        leases = self.leases
        with relay_transaction(bind, MARK_SETTINGS) as connection:
            connection.execute(delete(leases).where(leases.c.relay_id == relay_id))

    def mark_published(
        self, bind: Bind, records: Sequence[OutboxRecord], *, delete_rows: bool
    ) -> None:
        """Mark rows published, or delete them and count them per destination and hour
        in ``<prefix>outbox_counts`` (one statement on PostgreSQL, one transaction
        elsewhere)."""
        if not records:
            return
        ids = [record.id for record in records]
        params = {**ids_params(ids), "now": utcnow()}
        family = traits(bind).family
        if family == "postgresql":
            params["ids"] = _array_literal(ids)
        with relay_transaction(bind, MARK_SETTINGS) as connection:
            if not delete_rows:
                connection.execute(self._mark_statement(bind.dialect), params)
            elif family == "postgresql":
                params["hour"] = _hour(params["now"])
                connection.execute(self._delete_and_count_statement(), params)
            else:
                connection.execute(
                    delete(self.table).where(ids_clause(self.table.c.id, bind.dialect)), params
                )
                self._count(connection, records, _hour(params["now"]))

    @functools.cache  # noqa: B019 - two statements per store, built once
    def _mark_statement(self, dialect: Dialect) -> Any:
        table = self.table
        if traits(dialect).family == "postgresql":  # ids as an array literal
            ids = _array_parameter("ids")
            where = and_(
                table.c.id.between(
                    bindparam("low", type_=BigInteger), bindparam("high", type_=BigInteger)
                ),
                table.c.id == any_(ids),
            )
        else:
            where = ids_clause(table.c.id, dialect)
        return (
            update(table)
            .where(where)
            .values(
                state=PUBLISHED,
                published_at=bindparam("now", type_=table.c.published_at.type),
            )
        )

    @functools.cache  # noqa: B019 - one statement per store, built once
    def _delete_and_count_statement(self) -> Any:
        """PostgreSQL: delete the rows and add them to the hour's counters, atomically."""
        outbox, counts = self.table.name, self.counts.name
        return text(
            f"WITH gone AS (DELETE FROM {outbox} WHERE id BETWEEN :low AND :high "
            f"AND id = ANY(CAST(:ids AS bigint[])) RETURNING broker, destination) "
            f"INSERT INTO {counts} (broker, destination, hour, published) "
            "SELECT broker, destination, :hour, count(*) FROM gone "
            "GROUP BY broker, destination ORDER BY broker, destination "
            "ON CONFLICT (broker, destination, hour) "
            f"DO UPDATE SET published = {counts}.published + excluded.published"
        ).bindparams(bindparam("hour", type_=self.counts.c.hour.type))

    def _count(
        self, connection: Connection, records: Sequence[OutboxRecord], hour: datetime
    ) -> None:
        """MySQL/MariaDB, SQLite: add deleted rows to their destination's hour counter."""
        counted = Counter((record.broker, record.destination) for record in records)
        counts = self.counts
        values = [
            {"broker": broker, "destination": destination, "hour": hour, "published": n}
            for (broker, destination), n in sorted(counted.items())
        ]
        if traits(connection).family == "mysql":
            statement = mysql_insert(counts)
            connection.execute(
                statement.on_duplicate_key_update(
                    published=counts.c.published + statement.inserted.published
                ),
                values,
            )
            return
        upsert = sqlite_insert(counts)
        connection.execute(
            upsert.on_conflict_do_update(
                index_elements=[counts.c.broker, counts.c.destination, counts.c.hour],
                set_={"published": counts.c.published + upsert.excluded.published},
            ),
            values,
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
                )
            )
            count = result.rowcount
            if count and traits(engine).notifies:
                self._notify(connection)
        log.info("failed outbox rows put back", extra={"rows": count, "table": table.name})
        return count

    def purge(self, engine: Engine, older_than: timedelta, chunk_size: int = 5000) -> int:
        """Delete published rows older than ``older_than``, ``chunk_size`` rows per
        transaction; pending and failed rows are never touched. Returns rows deleted.

        Also drops the published counters of hours wholly older than ``older_than`` and
        leases expired that long ago (relays that died)."""
        table = self.table
        cutoff = utcnow() - older_than
        with engine.begin() as connection:
            connection.execute(
                delete(self.counts).where(self.counts.c.hour <= cutoff - timedelta(hours=1))
            )
            connection.execute(delete(self.leases).where(self.leases.c.locked_until < cutoff))
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
        """Counts of pending / failed / published rows, per destination too.

        Published: the rows marked published plus those deleted once published
        (``delete_published``, counted per hour), as far back as the retention keeps them.
        """
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
        counts = self.counts
        counted = select(
            counts.c.broker, counts.c.destination, literal(PUBLISHED), func.sum(counts.c.published)
        ).group_by(counts.c.broker, counts.c.destination)
        with engine.connect() as connection:
            rows: list[tuple[Any, ...]] = [tuple(row) for row in connection.execute(statement)]
            # Rows published and deleted (delete_published): their counters.
            rows += [(*row, None) for row in connection.execute(counted)]
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


def _claim_params(
    relay_id: str, limit: int, lease: timedelta, brokers: Collection[str], in_flight: Any
) -> dict[str, Any]:
    """The parameters every claim statement takes (unsharded; a shard filter adds its own)."""
    now = utcnow()
    return {
        "now": now,
        "until": now + lease,
        "relay_id": relay_id,
        "limit": limit,
        "in_flight": in_flight,
        "brokers": sorted(brokers),
        "lease_shards": "0",
    }


def _records(rows: Sequence[Any]) -> list[OutboxRecord]:
    """Claimed rows (columns as in the claim's ``RETURNING``) as records sorted by id.

    Per-row work is kept to what each row needs (this runs for every relayed row): the
    tuple is made without the named tuple's keyword-argument ``__new__``, and naive
    timestamps (MySQL, SQLite) are made aware only when the database returns naive ones.
    """
    if not rows:
        return []
    loads = _load_json
    make = tuple.__new__
    naive = rows[0][10].tzinfo is None
    records: list[OutboxRecord] = [
        make(
            OutboxRecord,
            (
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
                aware(row[10]) if naive else row[10],
            ),
        )
        for row in rows
    ]
    records.sort(key=_record_id)
    return records


#: The C scanner behind ``json.loads`` (not in the type stubs).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _load_json(text: str) -> Any:
    """``json.loads`` of a JSON column's text, with the same C scanner but without its
    per-call checks (about 3x faster on a small header object; runs per relayed row).
    Anything unusual (surrounding whitespace, invalid JSON) goes through ``json.loads``.
    """
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        return json.loads(text)
    if end != len(text):
        return json.loads(text)
    return value


def _array_parameter(name: str) -> ColumnElement[Any]:
    """PostgreSQL: ``CAST(:name AS bigint[])`` for an :func:`_array_literal` value.

    The parameter is untyped on purpose: the driver sends the text as *unknown*, so the
    server takes it as a ``bigint[]`` value, a constant of the plan. A text-typed
    parameter would be cast again on every row the claim examines.
    """
    return cast(bindparam(name), ARRAY(BigInteger))


def _array_literal(ids: Sequence[int]) -> str:
    """PostgreSQL: ``ids`` as an array literal (``{1,2,3}``), bound as one text value.

    Much cheaper than adapting a Python list element by element (up to ~1,500 ids per
    claim); the statement casts it to ``bigint[]``.
    """
    return "{" + ",".join(map(str, ids)) + "}"


def _hour(moment: datetime) -> datetime:
    """The start of ``moment``'s hour (the bucket of ``<prefix>outbox_counts``)."""
    return moment.replace(minute=0, second=0, microsecond=0)


def _not_in_flight(row_id: Any, postgresql: bool) -> ColumnElement[bool]:
    """The row is not among the ``in_flight`` ids (one array parameter on PostgreSQL)."""
    if postgresql:  # an array literal (see _array_literal)
        array = _array_parameter("in_flight")
        return row_id != all_(array)  # type: ignore[no-any-return]
    return row_id.not_in(bindparam("in_flight", expanding=True))  # type: ignore[no-any-return]


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
