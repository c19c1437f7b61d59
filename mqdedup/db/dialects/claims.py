"""The dedup table's statements that differ between databases: the claim (``INSERT … ON
CONFLICT DO NOTHING RETURNING``; on MySQL/MariaDB ``INSERT IGNORE``, see
:func:`claim_ids`), the attempt-counter upserts (``ON CONFLICT DO UPDATE`` / ``ON
DUPLICATE KEY UPDATE``, with the conditional one that counts an attempt before it runs),
an insert unless present, and the locking read that sees the latest committed row."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Select,
    Table,
    select,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session

from mqdedup.db.dialects.traits import MYSQL_DIALECTS

# The key columns are VARCHAR(255) (characters); INSERT IGNORE would truncate longer
# values into a silent collision, so longer ones are refused before any SQL.
_MYSQL_MAX_KEY_LENGTH = 255


def claim_ids(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """Insert ``ids`` (already sorted) for ``consumer``; return those that were new.

    One statement per batch. A concurrent transaction holding the same key makes this
    statement wait on the unique index until that transaction ends.
    """
    if not ids:
        return set()
    bind_dialect = session.get_bind().dialect
    dialect = bind_dialect.name
    if dialect == "postgresql":
        if len(ids) == 1:  # one message per transaction: a plain row, no array to unnest
            found = session.connection().exec_driver_sql(
                _pg_claim_one_sql(table.name), (consumer, ids[0], now)
            )
            return {row[0] for row in found}
        # Driver SQL on the session's connection (no ORM statement execution), the ids
        # as a binary array (psycopg quotes and escapes every element of a text one).
        claimed = session.connection().exec_driver_sql(
            _pg_claim_many_sql(table.name, binary=bind_dialect.driver == "psycopg"),
            {"consumer": consumer, "ids": list(ids), "now": now},
        )
        return set(claimed.scalars().all())  # one fetchall, not a fetchone per row
    if dialect == "sqlite":
        insert_stmt = sqlite.insert(table).values(
            [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in ids]
        )
        rows = session.execute(insert_stmt.on_conflict_do_nothing().returning(table.c.message_id))
        return {row[0] for row in rows}
    if dialect in MYSQL_DIALECTS:
        return _claim_ids_mysql(session, table, consumer, ids, now)
    raise NotImplementedError(f"claiming is not implemented for the {dialect!r} database")


@functools.cache
def _pg_claim_many_sql(table_name: str, *, binary: bool) -> str:
    """The batch claim as driver SQL; with psycopg 3 the ids go as a binary ``text[]``
    (``%(ids)b``), other drivers get the ``%(ids)s`` placeholder."""
    ids = "%(ids)b" if binary else "%(ids)s"
    return (
        f"INSERT INTO {table_name} (consumer_name, message_id, processed_at) "
        f"SELECT %(consumer)s, i, %(now)s FROM unnest({ids}::text[]) AS i ORDER BY i "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
    )


@functools.cache
def _pg_claim_one_sql(table_name: str) -> str:
    """The claim of one id, as driver SQL (no statement to compile per transaction)."""
    return (
        f"INSERT INTO {table_name} (consumer_name, message_id, processed_at) "
        "VALUES (%s, %s, %s) "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
    )


def _claim_ids_mysql(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """MySQL / MariaDB claim: ``INSERT IGNORE``, which waits on a concurrent holder.

    InnoDB's duplicate check takes a lock on an existing (even uncommitted) key, so a
    concurrent claim of the same id blocks until the holder commits (→ ignored, a
    duplicate) or rolls back (→ inserted, new), exactly like ``ON CONFLICT DO NOTHING``.

    * MariaDB >= 10.5: one statement, ``INSERT IGNORE … RETURNING message_id``, which
      returns only the rows it inserted.
    * MySQL (no ``RETURNING``): see :func:`_claim_ids_mysql_rowcount`.
    """
    check_mysql_key(consumer, ids)
    rows = [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in ids]
    insert_ignore = mysql.insert(table).prefix_with("IGNORE")
    bind = session.get_bind()
    if mysql_supports_returning(bind.dialect):
        result = session.execute(insert_ignore.values(rows).returning(table.c.message_id))
        return {row[0] for row in result}
    return _claim_ids_mysql_rowcount(session, table, consumer, ids, now)


def mysql_supports_returning(dialect: Any) -> bool:
    """True for MariaDB >= 10.5 (``INSERT … RETURNING``); MySQL has no ``RETURNING``."""
    return bool(getattr(dialect, "is_mariadb", False) and dialect.insert_returning)


def _claim_ids_mysql_rowcount(
    session: Session, table: Table, consumer: str, ids: Sequence[str], now: datetime
) -> set[str]:
    """Claim without ``RETURNING``, deciding every id by an ``INSERT IGNORE`` row count.

    1. A plain (consistent) read drops ids whose claims were committed earlier, the
       common kind of duplicate.
    2. Inside a savepoint, one ``INSERT IGNORE`` of the remaining candidates. If its row
       count equals their number, all of them are new (the usual case: 2 statements).
    3. Otherwise a concurrent transaction committed some of them meanwhile; roll back to
       the savepoint (InnoDB keeps the row locks) and claim the candidates one row at a
       time, each row's count (1 inserted / 0 ignored) saying whether it is new.

    Only step 3's per-row counts and step 2's all-inserted count decide: both come from
    the database's own duplicate check, so the result stays right under concurrency.
    """
    committed = {
        row[0]
        for row in session.execute(
            select(table.c.message_id).where(
                table.c.consumer_name == consumer, table.c.message_id.in_(list(ids))
            )
        )
    }
    candidates = [i for i in ids if i not in committed]
    if not candidates:
        return set()
    insert_ignore = mysql.insert(table).prefix_with("IGNORE")
    rows = [{"consumer_name": consumer, "message_id": i, "processed_at": now} for i in candidates]
    savepoint = session.begin_nested()
    inserted = session.execute(insert_ignore.values(rows)).rowcount  # type: ignore[attr-defined]
    if inserted == len(candidates):
        savepoint.commit()
        return set(candidates)
    savepoint.rollback()
    new: set[str] = set()
    for row in rows:
        if session.execute(insert_ignore.values(row)).rowcount == 1:  # type: ignore[attr-defined]
            new.add(str(row["message_id"]))
    return new


def check_mysql_key(consumer: str, ids: Sequence[str]) -> None:
    if len(consumer) > _MYSQL_MAX_KEY_LENGTH:
        raise ValueError(
            f"consumer name longer than {_MYSQL_MAX_KEY_LENGTH} characters: {consumer[:40]!r}…"
        )
    for message_id in ids:
        if len(message_id) > _MYSQL_MAX_KEY_LENGTH:
            raise ValueError(
                f"message id longer than {_MYSQL_MAX_KEY_LENGTH} characters: {message_id[:40]!r}…"
            )


def increment_attempts(
    session: Session, table: Table, consumer: str, message_id: str, error: str, now: datetime
) -> int:
    """Add one failed attempt for a message and return the total so far."""
    dialect = session.get_bind().dialect.name
    values: dict[str, Any] = {
        "consumer_name": consumer,
        "message_id": message_id,
        "attempts": 1,
        "last_error": error,
        "updated_at": now,
    }
    if dialect in ("postgresql", "sqlite"):
        module: Any = postgresql if dialect == "postgresql" else sqlite
        insert_stmt = module.insert(table).values(values)
        upsert = insert_stmt.on_conflict_do_update(
            index_elements=[table.c.consumer_name, table.c.message_id],
            set_={
                "attempts": table.c.attempts + 1,
                "last_error": insert_stmt.excluded.last_error,
                "updated_at": insert_stmt.excluded.updated_at,
            },
        ).returning(table.c.attempts)
        return int(session.execute(upsert).scalar_one())
    if dialect in MYSQL_DIALECTS:
        mysql_insert = mysql.insert(table).values(values)
        session.execute(
            mysql_insert.on_duplicate_key_update(
                attempts=table.c.attempts + 1,
                last_error=mysql_insert.inserted.last_error,
                updated_at=mysql_insert.inserted.updated_at,
            )
        )
        # Our upsert holds the row's lock until commit: this read sees our own count.
        counted = session.execute(
            select(table.c.attempts).where(
                table.c.consumer_name == consumer, table.c.message_id == message_id
            )
        )
        return int(counted.scalar_one())
    raise NotImplementedError(f"attempt counting is not implemented for the {dialect!r} database")


def start_attempt(
    session: Session,
    table: Table,
    consumer: str,
    message_id: str,
    marker: str,
    max_attempts: int,
    now: datetime,
) -> tuple[int, str | None, bool]:
    """Count one more attempt *before* it runs, unless ``max_attempts`` is reached.

    Returns ``(attempts, last_error, started)``: with ``started`` the count includes
    the attempt about to run and ``last_error`` is ``marker`` (it stays so until the
    attempt's outcome is recorded); otherwise nothing was written and the row's stored
    count and last error are returned. PostgreSQL and SQLite: one conditional upsert
    (plus a read only when the limit was reached); MySQL/MariaDB: a locking read, then
    the upsert.
    """
    dialect = session.get_bind().dialect.name
    key = (table.c.consumer_name == consumer, table.c.message_id == message_id)
    if dialect in ("postgresql", "sqlite"):
        module: Any = postgresql if dialect == "postgresql" else sqlite
        insert_stmt = module.insert(table).values(
            consumer_name=consumer,
            message_id=message_id,
            attempts=1,
            last_error=marker,
            updated_at=now,
        )
        upsert = insert_stmt.on_conflict_do_update(
            index_elements=[table.c.consumer_name, table.c.message_id],
            set_={
                "attempts": table.c.attempts + 1,
                "last_error": insert_stmt.excluded.last_error,
                "updated_at": insert_stmt.excluded.updated_at,
            },
            where=table.c.attempts < max_attempts,
        ).returning(table.c.attempts)
        counted = session.execute(upsert).scalar_one_or_none()
        if counted is not None:
            return int(counted), marker, True
        stored = session.execute(select(table.c.attempts, table.c.last_error).where(*key)).one()
        return int(stored.attempts), stored.last_error, False
    if dialect in MYSQL_DIALECTS:
        row = session.execute(
            select(table.c.attempts, table.c.last_error).where(*key).with_for_update()
        ).first()
        if row is not None and row.attempts >= max_attempts:
            return int(row.attempts), row.last_error, False
        counted = increment_attempts(session, table, consumer, message_id, marker, now)
        return counted, marker, True
    raise NotImplementedError(f"attempt counting is not implemented for the {dialect!r} database")


def latest_committed(statement: Select[Any]) -> Select[Any]:
    """``statement`` made to read the latest committed row version, not a snapshot.

    After a conditional ``UPDATE`` matched no row, the follow-up read must see what
    made it fail. A plain read may serve an older snapshot (MySQL/MariaDB's default
    REPEATABLE READ; PostgreSQL's REPEATABLE READ), so it becomes a shared locking read
    (``FOR SHARE`` / ``LOCK IN SHARE MODE``), which waits for a concurrent writer and
    reads the newest committed version (PostgreSQL above READ COMMITTED raises a
    serialization failure instead, which is transient and retried). SQLite ignores it:
    its writers are serialised already.
    """
    return statement.with_for_update(read=True)


def insert_unless_present(session: Session, table: Table, values: dict[str, Any]) -> None:
    """Insert one row unless it would repeat a unique key (then do nothing).

    ``ON CONFLICT DO NOTHING`` on PostgreSQL and SQLite; a no-op ``ON DUPLICATE KEY
    UPDATE`` on MySQL/MariaDB (``INSERT IGNORE`` would also hide data errors).
    """
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        module: Any = postgresql if dialect == "postgresql" else sqlite
        session.execute(module.insert(table).values(values).on_conflict_do_nothing())
        return
    if dialect in MYSQL_DIALECTS:
        primary = next(iter(table.primary_key.columns))
        statement = mysql.insert(table).values(values)
        session.execute(statement.on_duplicate_key_update({primary.name: primary}))
        return
    raise NotImplementedError(f"insert_unless_present is not implemented for {dialect!r}")
