"""The processed-messages table: claim, forget, stored results, attempts, purge.

:class:`DedupStore` is also the SQL claim store (the
:class:`~mqdedup.dedup.claims.ClaimStore` seam, ``SqlDedup()``): the processor's claim
goes from it straight to the dialect's statement (:func:`mqdedup.db.dialects.claim_ids`).

A statement with one parameter per message id is split into statements of at most
:func:`ids_per_statement` ids (in the caller's transaction, in sorted order for the
claim), so a batch of any size stays under the database's limit of bound parameters:
65,535 for PostgreSQL and MySQL / MariaDB, SQLite's own (32,766 by default since 3.32,
999 before; builds may raise it). Batches below the limit (every usual one) still take
one statement.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import (
    Engine,
    Text,
    bindparam,
    cast,
    delete,
    func,
    literal,
    literal_column,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.types import UserDefinedType

from mqdedup.db import dialects
from mqdedup.db.schema import DEFAULT_PREFIX, Schema, schema
from mqdedup.dedup.claims import Claims
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

#: The retention-horizon key of a purge that covered every consumer.
ALL_CONSUMERS = "*"


_Id = TypeVar("_Id", str, int)

#: Bound parameters one statement may carry, by database: the protocols of PostgreSQL
#: and MySQL count them in 16 bits; SQLite's default limit (a connection tells its own).
_MAX_PARAMETERS = {
    "sqlite": 32_766 if sqlite3.sqlite_version_info >= (3, 32) else 999,
    "postgresql": 65_535,
    "mysql": 65_535,
    "mariadb": 65_535,
}
#: Parameters of a statement besides its ids (the consumer name, a timestamp, ...).
_OTHER_PARAMETERS = 16


def ids_per_statement(session: Session, parameters_per_id: int = 1) -> int:
    """How many ids one statement on ``session``'s database may carry when each takes
    ``parameters_per_id`` bound parameters."""
    return max(1, (_parameter_limit(session) - _OTHER_PARAMETERS) // parameters_per_id)


def _parameter_limit(session: Session) -> int:
    name = session.get_bind().dialect.name
    if name == "sqlite":  # builds differ (Debian's allows 250,000): ask the connection
        driver = session.connection().connection.driver_connection
        getlimit = getattr(driver, "getlimit", None)  # sqlite3 (not aiosqlite)
        if getlimit is not None:
            return int(getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    return _MAX_PARAMETERS.get(name, 999)


def chunked(ids: Sequence[_Id], size: int) -> Iterator[Sequence[_Id]]:
    """``ids`` in consecutive slices of at most ``size`` (one slice when it fits)."""
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def id_chunks(session: Session, ids: Iterable[_Id]) -> Iterator[Sequence[_Id]]:
    """``ids`` in slices one statement with a parameter per id can carry (none if empty)."""
    id_list = list(ids)
    if id_list:
        yield from chunked(id_list, ids_per_statement(session))


def utcnow() -> datetime:
    """The current time, timezone-aware (UTC)."""
    return datetime.now(UTC)


def clean_text(text: str) -> str:
    """``text`` as every database stores it: no NUL, valid UTF-8 (escaped otherwise)."""
    if "\x00" not in text and text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def aware(moment: datetime) -> datetime:
    """A timestamp read back from the database, in UTC (databases without time zones,
    SQLite and MySQL, hand back naive UTC datetimes)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class DedupStore:
    """Reads and writes ``<prefix>processed_messages`` and ``<prefix>message_attempts``;
    the SQL :class:`~mqdedup.dedup.claims.ClaimStore` (``SqlDedup()``, the default).

    Every method that takes a ``session`` (the claim store's ``unit``) runs inside the
    caller's transaction: the claim is the first statement of the business transaction
    (``INSERT … ON CONFLICT DO NOTHING RETURNING``), so a concurrent duplicate blocks on
    the unique index until the first transaction ends, and commits or rolls back
    together with the business writes. Attempt counts (and careful mode's
    counted-before-running attempts) use short transactions of their own from
    ``sessions``, needed only by those methods.
    """

    transactional = True
    infrastructure = "database"
    lease: float | None = None

    def __init__(
        self, prefix: str = DEFAULT_PREFIX, sessions: sessionmaker[Session] | None = None
    ) -> None:
        self.schema: Schema = schema(prefix)
        self.sessions = sessions
        self._processed = self.schema.processed
        self._attempts = self.schema.attempts

    def is_transient(self, error: BaseException) -> bool:
        """Connection losses, deadlocks, serialization failures (see ``db.dialects``)."""
        return isinstance(error, Exception) and dialects.is_transient(error)

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        """A short transaction of its own (attempt counts)."""
        if self.sessions is None:
            raise ConfigurationError("this DedupStore was built without sessions")
        with self.sessions() as session, session.begin():
            yield session

    def claim(self, session: Session, consumer: str, ids: Iterable[str]) -> Claims:
        """Claim ``ids`` for ``consumer`` in one statement (a batch over the database's
        parameter limit: one per slice, in order); ``new``: the ids that were new
        (``done`` is left empty: see :meth:`results`).

        Ids are de-duplicated and sorted first so concurrent batches lock index entries
        in the same order and cannot deadlock on each other.
        """
        ordered = sorted(set(ids))
        if not ordered:
            return Claims()
        now = utcnow()
        # A claim row binds 3 parameters (consumer, id, time) on SQLite and MySQL.
        size = ids_per_statement(session, 3)
        if len(ordered) <= size:
            return Claims(new=dialects.claim_ids(session, self._processed, consumer, ordered, now))
        new: set[str] = set()
        for chunk in chunked(ordered, size):  # in order: no deadlock between batches
            new |= dialects.claim_ids(session, self._processed, consumer, chunk, now)
        return Claims(new=new)

    def renew(self, session: Session, consumer: str, ids: Sequence[str]) -> None:
        """Nothing: a claim is held until its transaction ends."""

    def forget(self, session: Session, consumer: str, ids: Iterable[str]) -> None:
        """Remove claims (a failed handler must not leave its message marked processed)."""
        table = self._processed
        for chunk in id_chunks(session, ids):
            session.execute(
                delete(table).where(
                    table.c.consumer_name == consumer, table.c.message_id.in_(chunk)
                )
            )

    def save_results(self, session: Session, consumer: str, results: Mapping[str, Any]) -> None:
        """Store handlers' JSON results next to their claims (one executemany; ``None``
        results need no write)."""
        results = {key: value for key, value in results.items() if value is not None}
        if not results:
            return
        table = self._processed
        statement = (
            update(table)
            .where(
                table.c.consumer_name == consumer,
                table.c.message_id == bindparam("b_message_id"),
            )
            .values(result=bindparam("b_result"))
        )
        session.connection().execute(
            statement,
            [{"b_message_id": key, "b_result": value} for key, value in results.items()],
        )

    def results(self, session: Session, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """Stored results of already-processed ids (ids without a result are absent)."""
        table = self._processed
        found: dict[str, Any] = {}
        for chunk in id_chunks(session, ids):
            rows = session.execute(
                select(table.c.message_id, table.c.result).where(
                    table.c.consumer_name == consumer,
                    table.c.message_id.in_(chunk),
                    table.c.result.is_not(None),
                )
            )
            found.update((row.message_id, row.result) for row in rows)
        return found

    def is_processed(self, session: Session, consumer: str, message_id: str) -> bool:
        """True when ``message_id`` has a committed claim for ``consumer``."""
        table = self._processed
        found = session.execute(
            select(table.c.message_id).where(
                table.c.consumer_name == consumer, table.c.message_id == message_id
            )
        ).first()
        return found is not None

    def record_failure(self, consumer: str, message_id: str, error: str) -> int:
        """Count one failed handler attempt in a transaction of its own; return the
        attempts so far (across redeliveries)."""
        with self._transaction() as session:
            # The error text may carry NUL or a lone surrogate, which PostgreSQL refuses.
            return dialects.increment_attempts(
                session, self._attempts, consumer, message_id, clean_text(error)[:2000], utcnow()
            )

    def forget_attempts(
        self, consumer: str, ids: Iterable[str], session: Session | None = None
    ) -> None:
        """Remove attempt counts: those messages get their full retries again (a replay);
        in ``session``'s transaction, else in one of its own."""
        if session is None:
            with self._transaction() as own:
                self.forget_attempts(consumer, ids, own)
            return
        table = self._attempts
        for chunk in id_chunks(session, ids):
            session.execute(
                delete(table).where(
                    table.c.consumer_name == consumer, table.c.message_id.in_(chunk)
                )
            )

    def start_attempt(
        self, session: Session, consumer: str, message_id: str, marker: str, max_attempts: int
    ) -> tuple[int, str | None, bool]:
        """Count an attempt before its handler runs (careful mode), in ``session``'s own
        transaction.

        Returns ``(attempts, last_error, started)``. ``started`` is False when
        ``max_attempts`` attempts were already recorded: nothing is written and the
        message must not run again.
        """
        with session.begin():
            return dialects.start_attempt(
                session, self._attempts, consumer, message_id, marker, max_attempts, utcnow()
            )

    def finish_attempt(self, consumer: str, message_id: str, error: str) -> None:
        """Record how an attempt counted by :meth:`start_attempt` failed (no second count)."""
        table = self._attempts
        with self._transaction() as session:
            session.execute(
                update(table)
                .where(table.c.consumer_name == consumer, table.c.message_id == message_id)
                .values(last_error=clean_text(error)[:2000], updated_at=utcnow())
            )

    def undo_attempt(self, consumer: str, message_id: str) -> None:
        """Take back an attempt counted by :meth:`start_attempt` whose handler never ran."""
        table = self._attempts
        with self._transaction() as session:
            session.execute(
                update(table)
                .where(
                    table.c.consumer_name == consumer,
                    table.c.message_id == message_id,
                    table.c.attempts > 0,
                )
                .values(attempts=table.c.attempts - 1)
            )

    def processed(
        self, consumer: str, ids: Sequence[str], session: Session | None = None
    ) -> dict[str, Any]:
        """The ids among ``ids`` with a committed claim, each with its stored result or None.

        One read (in ``session``, else in a transaction of its own). Only a filter: an id
        absent here may still be claimed concurrently, so whoever runs its handler claims
        it first as usual.
        """
        if session is None:
            with self._transaction() as own:
                return self.processed(consumer, ids, own)
        table = self._processed
        found: dict[str, Any] = {}
        for chunk in id_chunks(session, ids):
            rows = session.execute(
                select(table.c.message_id, table.c.result).where(
                    table.c.consumer_name == consumer, table.c.message_id.in_(chunk)
                )
            )
            found.update((row.message_id, row.result) for row in rows)
        return found

    def purge(
        self,
        engine: Engine,
        older_than: timedelta,
        consumer: str | None = None,
        chunk_size: int = 5000,
        on_chunk: Callable[[int], None] | None = None,
    ) -> int:
        """Delete claims (and attempt counters and recorded steps, :mod:`mqdedup.dedup.steps`)
        older than ``older_than``, in chunks.

        Each chunk is its own short transaction, so purging a large table never holds
        many locks at once. Returns the number of claims deleted. ``on_chunk`` is called
        with the claims each committed chunk deleted (a progress line).
        """
        cutoff = utcnow() - older_than
        total = 0
        for table, time_column in (
            (self._processed, self._processed.c.processed_at),
            (self._attempts, self._attempts.c.updated_at),
            (self.schema.steps, self.schema.steps.c.started_at),
        ):
            deleted = self._purge_table(
                engine,
                table,
                time_column,
                cutoff,
                consumer,
                chunk_size,
                on_chunk if table is self._processed else None,
            )
            if table is self._processed:
                total = deleted
        self._advance_horizon(engine, consumer or ALL_CONSUMERS, cutoff)
        log.info("purged dedup records", extra={"deleted": total, "cutoff": cutoff.isoformat()})
        return total

    def retention_horizon(self, engine: Engine, consumer: str) -> datetime | None:
        """Claims of ``consumer`` older than this may have been purged (None: never purged).

        A replay of messages older than the horizon could apply them a second time.
        """
        table = self.schema.retention
        with engine.connect() as connection:
            value = connection.execute(
                select(func.max(table.c.purged_before)).where(
                    table.c.consumer_name.in_([consumer, ALL_CONSUMERS])
                )
            ).scalar()
        if value is None:
            return None
        horizon: datetime = value if value.tzinfo else value.replace(tzinfo=UTC)
        return horizon

    def _advance_horizon(self, engine: Engine, consumer: str, cutoff: datetime) -> None:
        table = self.schema.retention
        now = utcnow()
        with engine.begin() as connection:
            moved = connection.execute(
                update(table)
                .where(table.c.consumer_name == consumer, table.c.purged_before < cutoff)
                .values(purged_before=cutoff, purged_at=now)
            ).rowcount
            if moved:
                return
            exists = connection.execute(
                select(table.c.consumer_name).where(table.c.consumer_name == consumer)
            ).first()
            if exists is None:
                connection.execute(
                    table.insert().values(
                        consumer_name=consumer, purged_before=cutoff, purged_at=now
                    )
                )

    @staticmethod
    def _purge_table(
        engine: Engine,
        table: Any,
        time_column: Any,
        cutoff: datetime,
        consumer: str | None,
        chunk_size: int,
        on_chunk: Callable[[int], None] | None = None,
    ) -> int:
        conditions = [time_column < cutoff]
        if consumer is not None:
            conditions.append(table.c.consumer_name == consumer)
        if engine.dialect.name == "postgresql":
            return _purge_by_ctid(engine, table, conditions, chunk_size, on_chunk)
        # By the whole primary key, and only rows still old: a message's steps are one
        # row per name, and a newer step of an old message is kept.
        primary = list(table.primary_key.columns)
        total = 0
        while True:
            with engine.begin() as connection:
                keys = connection.execute(
                    select(*primary).where(*conditions).order_by(time_column).limit(chunk_size)
                ).all()
                if keys:
                    key = tuple_(*primary)
                    connection.execute(
                        delete(table).where(key.in_([tuple(k) for k in keys]), *conditions)
                    )
            total += len(keys)
            if on_chunk is not None:
                on_chunk(len(keys))
            if len(keys) < chunk_size:
                return total


class _Tid(UserDefinedType[str]):
    """PostgreSQL's ``tid`` (a physical row id such as ``(12,3)``), for a cast."""

    cache_ok = True

    def get_col_spec(self, **_kw: Any) -> str:
        return "tid"


def _purge_by_ctid(
    engine: Engine,
    table: Any,
    conditions: list[Any],
    chunk_size: int,
    on_chunk: Callable[[int], None] | None = None,
) -> int:
    """PostgreSQL: delete the rows matching ``conditions`` in chunks, by physical row id.

    By ctid because a long IN-list of key pairs costs more to plan than to execute
    (measured: 9 s for 5,000 pairs). Any chunk of old rows will do, so there is no
    ORDER BY: the dedup table's BRIN index on ``processed_at`` (schema 3) finds them with
    a Bitmap Heap Scan, or the planner reads the table. The next chunk starts after the
    last row deleted (a TID range scan, PostgreSQL 14+): once purges have freed space
    that new claims refilled, old and new rows share block ranges, the BRIN summaries
    widen, and a chunk that started at the table's head each time would reread what the
    chunks before it skipped. A scan's order is not promised (a synchronized seq scan
    starts mid-table), so a pass that ends goes once more from the start and the purge
    is done when a chunk from the start comes back short.
    """
    # max(tid) and TID range scans came with PostgreSQL 14; before it, every chunk
    # starts at the head.
    resume = tuple(engine.dialect.server_version_info or ()) >= (14,)
    ctid: Any = literal_column("ctid")
    total = 0
    after: str | None = None
    while True:
        chunk: Any = select(ctid).select_from(table).where(*conditions)
        if after is not None:
            chunk = chunk.where(ctid > cast(literal(after), _Tid()))
        deleted_rows = (
            delete(table)
            .where(ctid == func.any(func.array(chunk.limit(chunk_size).scalar_subquery())))
            .returning(ctid.label("ctid"))
            .cte("deleted")
        )
        last_ctid: Any = cast(func.max(deleted_rows.c.ctid), Text) if resume else literal(None)
        with engine.begin() as connection:
            deleted, last = connection.execute(
                select(func.count(), last_ctid).select_from(deleted_rows)
            ).one()
        total += deleted
        if on_chunk is not None:
            on_chunk(int(deleted))
        if deleted == chunk_size:
            after = last  # None before PostgreSQL 14
        elif after is None:
            return int(total)
        else:
            after = None  # the pass ended: once more from the start
