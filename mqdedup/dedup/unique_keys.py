"""Insert or get: the unique-key technique, exact and safe inside a transaction.

``insert_or_get(session, table, row, key=[...])`` inserts ``row`` or, when a row with
the same ``key`` values exists already, returns that stored row, and says which
happened. In a handler: ``ctx.insert_or_get(Table, row, key=[...])``::

    found = ctx.insert_or_get(customers, {"email": email, "name": name}, key=["email"])
    if found.inserted:
        ctx.outbox.publish({"customer": found.row.id}, topic="customer-created")

It replaces the hand-written "insert, catch the unique-key violation, read back", which
on PostgreSQL aborts the transaction (and with it the message's batch-mates) unless it
runs in a savepoint. Here no statement ever fails on the key, on any database:

* PostgreSQL and SQLite: ``INSERT … ON CONFLICT (key) DO NOTHING RETURNING *``; when
  it returns no row, ``SELECT … WHERE key = …``. A concurrent transaction inserting the
  same key makes the insert wait on the unique index until it ends: if it commits, the
  read (a new snapshot under READ COMMITTED) returns its row; if it rolls back, ours is
  inserted. Under REPEATABLE READ / SERIALIZABLE PostgreSQL reports a conflict with a
  row the snapshot cannot see as a serialization failure, which is transient: the
  consumer's processor (or :func:`~mqdedup.dedup.transitions.run_transaction`) reruns
  the transaction.
* MySQL / MariaDB: a plain ``INSERT`` (``RETURNING *`` on MariaDB >= 10.5). A duplicate
  key (error 1062) rolls back that one statement only, never the transaction, so it is
  answered by a locking read of the stored row (``LOCK IN SHARE MODE``: the latest
  committed version, which a REPEATABLE READ snapshot may not show). ``INSERT IGNORE``
  would hide other errors (truncation, NULLs) as warnings, and the row count of
  ``ON DUPLICATE KEY UPDATE`` cannot tell "inserted" from "found" with the
  ``CLIENT_FOUND_ROWS`` flag SQLAlchemy's drivers set.

``key`` must be the columns of the primary key, a unique constraint or a (non-partial)
unique index declared on the table; otherwise :class:`InsertOrGetError` names the table
and its unique keys before any SQL runs. A row that breaks *another* constraint (a
second unique key, NOT NULL, a foreign key) raises as a plain insert would.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    Dialect,
    Row,
    Select,
    Table,
    UniqueConstraint,
    bindparam,
    inspect,
    select,
)
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, NoInspectionAvailable
from sqlalchemy.orm import Mapper, Session
from sqlalchemy.sql.elements import ClauseElement

from mqdedup.db.dialects import (
    is_unique_violation,
    latest_committed,
    mysql_supports_returning,
    traits,
)
from mqdedup.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

# The stored row can vanish between the conflict and the read (a concurrent DELETE):
# then the key is free again and the insert is tried anew, a few times at most.
_ATTEMPTS = 3


class InsertOrGetError(ConfigurationError):
    """``insert_or_get`` was called wrongly: a target that is no table, a key that is
    not a unique key of the table, a row without the key's values or with unknown
    columns (raised before any SQL runs); or the key's row was deleted concurrently
    between the insert and the read, again and again."""


@dataclass(frozen=True, slots=True)
class InsertOrGet:
    """What :func:`insert_or_get` did.

    ``row`` is the stored row with every column of the table (a SQLAlchemy ``Row``:
    ``found.row.id``, ``found.row._mapping["id"]``): the one just inserted, with its
    defaults and generated key, or the one that was there. ``inserted`` is True when
    this call inserted it, False when a row with the key existed (committed by another
    transaction, or written earlier in this one).
    """

    row: Row[Any]
    inserted: bool

    @property
    def existed(self) -> bool:
        """True when the key was taken already and ``row`` is the stored one."""
        return not self.inserted


def insert_or_get(
    session: Session | Connection,
    target: Any,
    row: Mapping[str, Any],
    *,
    key: str | Sequence[str],
) -> InsertOrGet:
    """Insert ``row`` into ``target``, or return the row stored under the same ``key``.

    ``session`` is a ``Session`` or ``Connection`` in a transaction (a handler's
    ``ctx.session``, a web request's session); nothing is committed or rolled back, no
    savepoint is needed and the transaction stays usable whatever the outcome.
    ``target`` is a ``Table`` or an ORM mapped class; ``row`` maps column names to
    values; ``key`` names the columns of a unique key of the table (all present in
    ``row``, not None). Concurrent callers with the same key create one row, and each
    gets that row. See the module docstring for the statements per database.
    """
    table = table_of(target)
    names = _checked_row(table, key, row)
    if isinstance(session, Session):
        session.flush()  # pending ORM objects must be in the table before the key check
    connection = session.connection() if isinstance(session, Session) else session
    statements = _statements(table, names, connection.dialect)  # the dialect is connected
    key_values = {f"key_{name}": row[name] for name in names}
    # SQL expressions among the values (func.now()) are inlined; plain values are bound
    # parameters of the statement built once per table, key and database.
    inline = any(isinstance(value, ClauseElement) for value in row.values())
    write = statements.insert.values(dict(row)) if inline else statements.insert
    params = None if inline else dict(row)
    for _ in range(_ATTEMPTS):
        if statements.mysql:
            found = _mysql_attempt(session, table, statements, write, params, row, key_values)
        else:
            inserted = session.execute(write, params).first()
            if inserted is not None:
                return InsertOrGet(inserted, True)
            existing = session.execute(statements.read, key_values).first()
            found = None if existing is None else InsertOrGet(existing, False)
        if found is not None:
            return found
    raise InsertOrGetError(
        f"insert_or_get into {table.name}: the row of key ({', '.join(names)}) was deleted "
        f"concurrently {_ATTEMPTS} times between the insert and the read"
    )


@dataclass(frozen=True, slots=True)
class _Statements:
    """The insert and the read of one table, key and database (built once)."""

    insert: Any
    read: Select[Any]
    #: MySQL/MariaDB: a plain insert, answered by a locking read on error 1062.
    mysql: bool
    #: The insert returns the row (``RETURNING *``); else it is read back.
    returning: bool


@functools.lru_cache(maxsize=1024)
def _statements(table: Table, names: tuple[str, ...], dialect: Dialect) -> _Statements:
    columns = [table.c[name] for name in names]
    read = select(*table.c).where(*(c == bindparam(f"key_{c.key}") for c in columns))
    family = traits(dialect).family
    if family == "mysql":
        returning = mysql_supports_returning(dialect)
        statement: Any = mysql_dialect.insert(table)
        if returning:
            statement = statement.returning(*table.c)
        return _Statements(statement, latest_committed(read), mysql=True, returning=returning)
    module: Any = postgresql if family == "postgresql" else sqlite
    statement = (
        module.insert(table).on_conflict_do_nothing(index_elements=columns).returning(*table.c)
    )
    return _Statements(statement, read, mysql=False, returning=True)


def _mysql_attempt(
    session: Session | Connection,
    table: Table,
    statements: _Statements,
    write: Any,
    params: dict[str, Any] | None,
    row: Mapping[str, Any],
    key_values: dict[str, Any],
) -> InsertOrGet | None:
    """One plain INSERT; on a duplicate key, the locking read (None: no such row)."""
    try:
        result = session.execute(write, params)
    except IntegrityError as error:
        if not is_unique_violation(error):
            raise
        # Error 1062 rolled back this statement alone; the transaction goes on.
        existing = session.execute(statements.read, key_values).first()
        if existing is None:
            # The conflict was on another unique key (raise it), or the row is gone
            # (try again).
            if _conflicts_elsewhere(session, table, row):
                raise
            return None
        return InsertOrGet(existing, False)
    inserted = (
        result.first()
        if statements.returning
        else session.execute(statements.read, key_values).first()
    )
    if inserted is None:  # pragma: no cover - our own insert is visible to us
        raise InsertOrGetError(f"insert_or_get into {table.name}: the inserted row is not readable")
    return InsertOrGet(inserted, True)


def _conflicts_elsewhere(
    session: Session | Connection, table: Table, row: Mapping[str, Any]
) -> bool:
    """True when another unique key of ``table`` already holds ``row``'s values."""
    for columns in declared_unique_keys(table):
        if all(name in row and row[name] is not None for name in columns):
            condition = [table.c[name] == row[name] for name in columns]
            if session.execute(latest_committed(select(*table.c).where(*condition))).first():
                return True
    return False


async def async_insert_or_get(
    session: AsyncSession | AsyncConnection,
    target: Any,
    row: Mapping[str, Any],
    *,
    key: str | Sequence[str],
) -> InsertOrGet:
    """:func:`insert_or_get` for an ``AsyncSession`` or ``AsyncConnection`` (awaitable)."""
    return await session.run_sync(insert_or_get, target, row, key=key)


def table_of(target: Any) -> Table:
    """The ``Table`` of ``target`` (a ``Table`` or an ORM mapped class)."""
    if isinstance(target, Table):
        return target
    try:
        mapper = inspect(target)
    except NoInspectionAvailable:
        mapper = None
    if not isinstance(mapper, Mapper):
        raise InsertOrGetError(
            f"insert_or_get needs a Table or an ORM mapped class, not {target!r}"
        )
    table = mapper.local_table
    if not isinstance(table, Table):
        raise InsertOrGetError(f"insert_or_get: {mapper.class_.__name__} is not mapped to a table")
    return table


def declared_unique_keys(table: Table) -> list[tuple[str, ...]]:
    """The column keys of each unique key declared on ``table``: the primary key,
    unique constraints, ``unique=True`` columns and unique indexes without a WHERE."""
    keys: list[tuple[str, ...]] = []

    def add(names: Sequence[str]) -> None:
        ordered = tuple(names)
        if ordered and frozenset(ordered) not in {frozenset(k) for k in keys}:
            keys.append(ordered)

    add([column.key for column in table.primary_key.columns])
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            add([column.key for column in constraint.columns])
    for column in table.columns:
        if column.unique:
            add([column.key])
    for index in table.indexes:
        partial = any(
            index.dialect_kwargs.get(f"{name}_where") is not None
            for name in ("postgresql", "sqlite")
        )
        plain = len(index.expressions) == len(index.columns)  # no expression parts
        if index.unique and plain and not partial:
            add([column.key for column in index.columns])
    return keys


def _checked_row(table: Table, key: str | Sequence[str], row: Mapping[str, Any]) -> tuple[str, ...]:
    """The key's column names, after checking the key and the row (InsertOrGetError)."""
    names = (key,) if isinstance(key, str) else tuple(key) if _is_names(key) else None
    if not names:
        raise InsertOrGetError(
            f"insert_or_get into {table.name}: key must name one or more columns, not {key!r}"
        )
    if not isinstance(row, Mapping):
        raise InsertOrGetError(
            f"insert_or_get into {table.name}: row must be a mapping of column names to "
            f"values, not {type(row).__name__}"
        )
    unknown = sorted(str(name) for name in set(names).union(row) if name not in table.c)
    if unknown:
        raise InsertOrGetError(
            f"insert_or_get into {table.name}: no column {', '.join(map(repr, unknown))} "
            f"(columns: {', '.join(table.c.keys())})"
        )
    missing = [name for name in names if row.get(name) is None]
    if missing:
        raise InsertOrGetError(
            f"insert_or_get into {table.name}: the row has no value for key column(s) "
            f"{', '.join(map(repr, missing))} (NULL never conflicts, so nothing could be got)"
        )
    expressions = [name for name in names if isinstance(row[name], ClauseElement)]
    if expressions:
        raise InsertOrGetError(
            f"insert_or_get into {table.name}: key column(s) {', '.join(map(repr, expressions))} "
            "need a plain value, not a SQL expression (the stored row is read by it)"
        )
    if not _is_unique_key(table, frozenset(names)):
        declared = (
            "; ".join("(" + ", ".join(k) + ")" for k in declared_unique_keys(table)) or "none"
        )
        raise InsertOrGetError(
            f"insert_or_get into {table.name}: key ({', '.join(names)}) is not a unique key "
            f"of the table (declared unique keys: {declared}); add a unique constraint or "
            "index on these columns, or pass one of the declared keys"
        )
    return names


def _is_names(key: Any) -> bool:
    return isinstance(key, Sequence) and all(isinstance(name, str) for name in key)


@functools.lru_cache(maxsize=1024)
def _is_unique_key(table: Table, names: frozenset[str]) -> bool:
    return names in {frozenset(k) for k in declared_unique_keys(table)}
