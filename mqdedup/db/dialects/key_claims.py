"""The claim of an HTTP idempotency key (:mod:`mqdedup.dedup.request_keys`): taken at
once or found held, never waited for, and reclaimed in place once expired."""

from __future__ import annotations

import functools
import hashlib
from datetime import datetime

from sqlalchemy import (
    Table,
    null,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from mqdedup.db.dialects.claims import check_mysql_key, claim_ids
from mqdedup.db.dialects.errors import MYSQL_LOCK_WAIT_TIMEOUT, mysql_code
from mqdedup.db.dialects.traits import traits


def claim_key_nowait(
    session: Session,
    table: Table,
    consumer: str,
    key: str,
    now: datetime,
    *,
    expired_before: datetime | None = None,
) -> str:
    """Claim one key without waiting for a transaction in flight that holds it.

    Returns ``"new"`` (claimed now), ``"taken"`` (claimed by a committed transaction) or
    ``"busy"`` (held by a transaction still in flight; nothing was written). For HTTP
    idempotency keys (:mod:`mqdedup.dedup.request_keys`), where a repeat in flight is
    answered 409 at once instead of waiting on the unique index like a message claim.

    ``expired_before``: a committed claim older than this is claimed again in place
    (``processed_at`` set to ``now``, ``result`` cleared) by one conditional UPDATE in
    this transaction, and the answer is ``"new"``; of two requests reusing an expired
    key at once, one claims it and the other gets ``"busy"``.

    * PostgreSQL: ``pg_try_advisory_xact_lock`` on a 64-bit hash of the key first (held
      until the transaction ends; every claim of the key takes it), so the claim never
      meets an uncommitted row of another transaction. When another transaction holds
      the lock, a committed row means ``taken`` (the holder is another repeat), none
      ``busy``; an expired one ``busy`` too (the holder claims it again). One statement
      (a CTE), no error: the transaction stays usable. The UPDATE of an expired key runs
      only under the lock.
    * MariaDB: the claim (and the UPDATE of an expired key) with
      ``innodb_lock_wait_timeout=0`` for that statement only (``SET STATEMENT … FOR``);
      a lock wait is error 1205 → ``busy``. MySQL (no ``SET STATEMENT``) waits like a
      message claim.
    * SQLite: writers are serialised (``BEGIN IMMEDIATE``), so a key is never held by
      another transaction: the repeat waited for the first one at ``BEGIN``.
    """
    family = traits(session.get_bind()).family
    if family == "postgresql":
        lock = hashlib.sha256(f"{table.name}\x00{consumer}\x00{key}".encode()).digest()[:8]
        row = (
            session.connection()
            .exec_driver_sql(
                _pg_claim_key_sql(table.name),
                (
                    int.from_bytes(lock, "big", signed=True),
                    consumer,
                    key,
                    now,
                    expired_before,
                    consumer,
                    key,
                ),
            )
            .one()
        )
        taken, inserted, committed = row  # committed: None (no row), else "expired?"
        if not taken:
            # Held by a transaction in flight: the first request, a repeat of a key
            # already committed (which only reads it), or one claiming it again.
            return "taken" if committed is False else "busy"
        if inserted:
            return "new"
        if committed and _reclaim(session, table, consumer, key, now, expired_before):
            return "new"
        return "taken"
    # The dialect knows it speaks to MariaDB once connected (a cold engine's first
    # requests would otherwise take the claim that waits).
    dialect = session.connection().dialect
    mariadb = family == "mysql" and getattr(dialect, "is_mariadb", False)
    if expired_before is not None and _expired(session, table, consumer, key, expired_before):
        # Read first (no lock), UPDATE only an expired row: a fresh key's concurrent
        # repeats never lock each other out of their replay.
        try:
            if _reclaim(session, table, consumer, key, now, expired_before, nowait=mariadb):
                return "new"
        except sa_exc.OperationalError as error:
            if mariadb and mysql_code(error) == MYSQL_LOCK_WAIT_TIMEOUT:
                return "busy"
            raise
    if mariadb:
        check_mysql_key(consumer, [key])
        # For this statement only: a key held by a transaction in flight is error 1205 at once.
        statement = text(
            "SET STATEMENT innodb_lock_wait_timeout=0 FOR "
            f"INSERT IGNORE INTO {table.name} (consumer_name, message_id, processed_at) "
            "VALUES (:consumer, :key, :now)"
        )
        try:
            result = session.execute(statement, {"consumer": consumer, "key": key, "now": now})
            inserted = result.rowcount  # type: ignore[attr-defined]
        except sa_exc.OperationalError as error:
            if mysql_code(error) == MYSQL_LOCK_WAIT_TIMEOUT:
                return "busy"
            raise
        return "new" if inserted == 1 else "taken"
    return "new" if claim_ids(session, table, consumer, [key], now) else "taken"


def _expired(
    session: Session, table: Table, consumer: str, key: str, expired_before: datetime
) -> bool:
    """True when the key has a committed claim older than ``expired_before`` (no lock)."""
    found = session.execute(
        select(table.c.processed_at).where(
            table.c.consumer_name == consumer,
            table.c.message_id == key,
            table.c.processed_at < expired_before,
        )
    ).first()
    return found is not None


def _reclaim(
    session: Session,
    table: Table,
    consumer: str,
    key: str,
    now: datetime,
    expired_before: datetime | None,
    *,
    nowait: bool = False,
) -> bool:
    """Claim a committed, expired key again in place: True when this UPDATE did."""
    if expired_before is None:
        return False
    if nowait:  # MariaDB: a row locked by another transaction is error 1205 at once
        result = session.execute(
            text(
                "SET STATEMENT innodb_lock_wait_timeout=0 FOR "
                f"UPDATE {table.name} SET processed_at = :now, result = NULL "
                "WHERE consumer_name = :consumer AND message_id = :key AND processed_at < :cutoff"
            ),
            {"now": now, "consumer": consumer, "key": key, "cutoff": expired_before},
        )
    else:
        result = session.execute(
            table.update()
            .where(
                table.c.consumer_name == consumer,
                table.c.message_id == key,
                table.c.processed_at < expired_before,
            )
            .values(processed_at=now, result=null())
        )
    return bool(result.rowcount)  # type: ignore[attr-defined]


@functools.cache
def _pg_claim_key_sql(table_name: str) -> str:
    """One round trip: the key's advisory lock, the claim if locked, a committed row
    (NULL: none; else whether it expired)?"""
    return (
        "WITH lock AS (SELECT pg_try_advisory_xact_lock(%s) AS taken), "
        f"claimed AS (INSERT INTO {table_name} (consumer_name, message_id, processed_at) "
        "SELECT %s, %s, %s FROM lock WHERE taken "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING 1) "
        "SELECT (SELECT taken FROM lock), EXISTS (SELECT 1 FROM claimed), "
        "(SELECT COALESCE(processed_at < %s::timestamptz, false) "
        f"FROM {table_name} WHERE consumer_name = %s AND message_id = %s)"
    )
