"""The outbox relay's database specifics: its session settings and transactions, the
id-list clause, the checks that a relay still holds its shard locks, table sizes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    Dialect,
    Engine,
    TextClause,
    and_,
    any_,
    bindparam,
    text,
)
from sqlalchemy.sql.elements import ColumnElement

from mqdedup.db.dialects.traits import traits

# PostgreSQL settings of the relay's statements. The planner settings keep the claim on
# the pending index in id order, stopping at the limit, and the update on the primary
# key, even when the statistics still describe an almost empty table (a fresh backlog).
# Leases and marks need no synchronous commit: one lost in a database crash only means a
# row is published again, which the at-least-once contract allows anyway.
_PLANNER = ("enable_sort", "enable_bitmapscan", "enable_hashjoin", "enable_mergejoin")
RELAY_SESSION_SETTINGS = [f"SET {name} = off" for name in _PLANNER] + [
    "SET synchronous_commit = off",
    # Short statements: the planner settings above inflate a small sort's cost estimate
    # past jit_above_cost, and compiling it then took ~500 ms of a 2 ms delete-mark.
    "SET jit = off",
]
#: The same settings for one transaction (a claim on a pooled connection).
CLAIM_SETTINGS = text(
    "; ".join(setting.replace("SET ", "SET LOCAL ") for setting in RELAY_SESSION_SETTINGS)
)

#: For one transaction that marks or releases rows.
MARK_SETTINGS = text("SET LOCAL synchronous_commit = off")


def prepare_relay_connection(connection: Connection) -> Connection:
    """Make ``connection`` a relay connection.

    PostgreSQL: autocommit (each statement is its own short transaction, one round trip)
    with the relay's session settings. MySQL/MariaDB: ``READ COMMITTED`` for the session
    (the claim's locking read then locks only the rows it returns, and no gaps that
    would hold up writers); each store method runs its own transaction on it.

    Detach the connection from the pool afterwards (the settings stay on it).
    """
    if traits(connection).family == "mysql":
        return connection.execution_options(isolation_level="READ COMMITTED")
    connection = connection.execution_options(isolation_level="AUTOCOMMIT")
    for setting in RELAY_SESSION_SETTINGS:
        connection.exec_driver_sql(setting)
    return connection


@contextmanager
def relay_transaction(bind: Engine | Connection, settings: TextClause) -> Iterator[Connection]:
    """A short transaction on an engine or a relay connection.

    On a PostgreSQL relay connection (autocommit) each statement is its own transaction;
    on an engine, ``settings`` (:data:`CLAIM_SETTINGS`, :data:`MARK_SETTINGS`) apply to
    the transaction. On MySQL/MariaDB the transaction runs at ``READ COMMITTED`` (see
    :func:`prepare_relay_connection`; on an engine it is set for this transaction).
    """
    family = traits(bind).family
    if isinstance(bind, Connection):
        if family != "mysql":
            yield bind
            return
        with bind.begin():
            yield bind
        return
    with bind.begin() as connection:
        if family == "postgresql":
            connection.execute(settings)
        elif family == "mysql":
            # Before the transaction's first statement: applies to this transaction only.
            connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        yield connection


def ids_clause(column: Any, dialect: Dialect) -> ColumnElement[bool]:
    """``column`` is one of the ``ids`` parameter (see :func:`ids_params`).

    PostgreSQL: ``= ANY(:ids)`` with one array parameter, plus the ids' range, which lets
    the planner walk the primary key instead of scanning the table (it underestimates
    what ``= ANY(array)`` selects). Elsewhere: ``IN (…)``.
    """
    if traits(dialect).family == "postgresql":
        array = bindparam("ids", type_=ARRAY(BigInteger))
        clause: ColumnElement[bool] = and_(
            column.between(bindparam("low", type_=BigInteger), bindparam("high", type_=BigInteger)),
            column == any_(array),
        )
        return clause
    membership: ColumnElement[bool] = column.in_(bindparam("ids", expanding=True))
    return membership


def ids_params(ids: Sequence[int]) -> dict[str, Any]:
    """The parameters of :func:`ids_clause`."""
    return {"ids": list(ids), "low": min(ids), "high": max(ids)}


#: PostgreSQL: the relay's lock connection (backend ``owner_pid``) still holds the
#: advisory locks ``(lock_class, s)`` of all ``owned`` shards. An uncorrelated subquery
#: of the claim, evaluated once per claim.
ADVISORY_LOCKS_HELD = text(
    "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = CAST(:lock_class AS oid) AND objsubid = 2 AND pid = :owner_pid "
    "AND granted AND objid::bigint = ANY(CAST(:owned AS bigint[]))) = :owned_count"
)


def named_locks_held(connection: Connection, names: Sequence[str], owner: int) -> bool:
    """MySQL/MariaDB: the connection ``owner`` still holds every named lock ``names``."""
    if not names:
        return False
    checks = " AND ".join(f"IS_USED_LOCK(:n{i}) <=> :owner" for i in range(len(names)))
    params: dict[str, Any] = {f"n{i}": name for i, name in enumerate(names)}
    params["owner"] = owner
    return bool(connection.execute(text(f"SELECT {checks}"), params).scalar())


def table_size(connection: Connection, table_name: str) -> int | None:
    """The table's size on disk in bytes, indexes included (PostgreSQL; else ``None``)."""
    if traits(connection).family != "postgresql":
        return None
    size = connection.execute(
        text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": table_name}
    ).scalar()
    return None if size is None else int(size)
