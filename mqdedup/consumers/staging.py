"""Staged writes: per-message handlers whose inserts and updates run set-based per batch.

A handler calls ``ctx.stage(orders, {...})`` (a table: one INSERT row) or
``ctx.stage(statement, {...})`` (an INSERT / UPDATE / DELETE with bind parameters)
instead of executing the statement itself. The processor collects the rows per
statement and, after the batch's last handler and before the results are stored and
the transaction commits, executes each statement once with all its rows (an
executemany; SQLAlchemy sends INSERTs as multi-row ``VALUES`` lists).

The order rule: staged statements run after all handlers of the batch, grouped by
statement, the groups in the order of their first use and the rows of a group in the
order they were staged. A handler does not see its staged rows (they are not written
yet); write what a later read of the same handler needs with ``ctx.session``.

A staged write that fails at the batch end cannot be traced to one message: the
transaction rolls back and the batch runs again with every ``ctx.stage`` executed at
once, inside its handler's failure boundary, so the culprit fails alone (retry policy,
dead letter) and its batch-mates commit. Transient errors (a lost connection, a
deadlock) are retried as always.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    Date,
    DateTime,
    Dialect,
    Enum,
    Float,
    Integer,
    LargeBinary,
    Numeric,
    String,
    Table,
    Uuid,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Delete, Insert, Update

if TYPE_CHECKING:
    from mqdedup.consumers.deferral import DeferredWrites

#: What ``ctx.stage`` accepts: a table (an INSERT of the row) or a DML statement.
Stageable = Table | Insert | Update | Delete

#: The array each column type travels in: the base type without length or precision,
#: so that the INSERT's own assignment cast checks the values (an explicit cast to
#: ``varchar(n)`` would cut a long string instead of refusing it).
_ARRAY_TYPES: tuple[tuple[type[Any], str], ...] = (
    (String, "text"),
    (Integer, "bigint"),
    (Float, "float8"),
    (Numeric, "numeric"),
    (Date, "date"),
    (Uuid, "uuid"),
)

_STAGED_KEY = "mqdedup.staged"


class StagedWriteError(TypeError):
    """``ctx.stage`` was given something it cannot run set-based (the handler's bug)."""


class _Group:
    """One statement and the rows staged for it (``table``: a Table's INSERT rows)."""

    __slots__ = ("rows", "statement", "table")

    def __init__(self, statement: Insert | Update | Delete, table: Table | None) -> None:
        self.statement = statement
        self.table = table
        self.rows: list[Mapping[str, Any]] = []


class StagedWrites:
    """The rows a transaction's handlers staged, per statement, in first-use order.

    ``immediate``: run every staged row at once instead (the rerun that finds the
    message a failing staged write belongs to).
    """

    def __init__(self, session: Session, *, immediate: bool = False) -> None:
        self.session = session
        self.immediate = immediate
        self._groups: dict[Any, _Group] = {}
        #: Statement objects seen, by id (held, so an id is not reused in this batch).
        self._seen: dict[int, tuple[Stageable, Any]] = {}
        #: The group of every staged row, in staging order (to undo a failed handler's).
        self._journal: list[_Group] = []
        #: The handlers' deferred ``ctx.session.execute`` writes (written before the stage).
        self.deferred: DeferredWrites | None = None

    def __len__(self) -> int:
        return len(self._journal) + (len(self.deferred) if self.deferred is not None else 0)

    def add(self, target: Stageable, row: Mapping[str, Any]) -> None:
        """Stage ``row`` for ``target`` (run now when ``immediate``)."""
        if not isinstance(row, Mapping):
            raise StagedWriteError(
                f"ctx.stage() takes one row as a mapping of column names to values, "
                f"not {type(row).__name__}"
            )
        group = self._group(target)
        if self.immediate:
            self.session.connection().execute(group.statement, dict(row))
            return
        group.rows.append(dict(row))  # a copy: the handler may reuse its dict
        self._journal.append(group)

    def mark(self) -> int:
        """A point to :meth:`undo` to (before a handler that may fail in a savepoint)."""
        return len(self._journal)

    def undo(self, mark: int) -> None:
        """Drop the rows staged after ``mark`` (their handler failed)."""
        while len(self._journal) > mark:
            self._journal.pop().rows.pop()

    def flush(self) -> None:
        """Write the deferred writes, then run every staged statement once with its
        rows; empty the stage."""
        if self.deferred is not None:
            self.deferred.flush()
        groups = [group for group in self._groups.values() if group.rows]
        self._groups.clear()
        self._seen.clear()
        self._journal.clear()
        if not groups:
            return
        connection: Connection = self.session.connection()
        for group in groups:
            rows = group.rows
            table = group.table
            if table is not None and len(rows) > 1 and insert_unnest(connection, table, rows):
                continue
            connection.execute(group.statement, rows if len(rows) > 1 else rows[0])

    def _group(self, target: Stageable) -> _Group:
        seen = self._seen.get(id(target))
        key = seen[1] if seen is not None else self._key(target)
        group = self._groups.get(key)
        if group is None:
            if isinstance(target, Table):
                group = _Group(target.insert(), target)
            else:
                group = _Group(target, None)
            self._groups[key] = group
        return group

    def _key(self, target: Stageable) -> Any:
        """Statements with the same SQL share a group; one with values built in (e.g.
        ``.values(a=1)``, ``where(t.c.id == 5)``) is a group of its own."""
        if isinstance(target, Table):
            key: Any = ("table", target)
        elif isinstance(target, Insert | Update | Delete):
            if target._returning:
                raise StagedWriteError(
                    "ctx.stage() cannot run a statement with RETURNING: staged rows are "
                    "written at the batch end and nothing reads their results; execute it "
                    "with ctx.session.execute() instead"
                )
            cache_key = target._generate_cache_key()
            if cache_key is None or any(not bind.required for bind in cache_key.bindparams):
                key = ("own", id(target))
            else:
                key = ("sql", cache_key.key)
        else:
            raise StagedWriteError(
                "ctx.stage() takes a Table (one INSERT row) or an insert() / update() / "
                f"delete() statement, not {type(target).__name__}"
            )
        self._seen[id(target)] = (target, key)
        return key


def insert_unnest(connection: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> bool:
    """PostgreSQL (psycopg): a Table's rows as one ``INSERT … SELECT FROM unnest(…)``.

    One statement with one array per column (binary), as a bulk handler would write
    it: several times cheaper than an executemany. False (nothing written) when the
    rows or columns need SQLAlchemy's own handling: another database, rows with
    different keys, a column type with bind processing (JSON, Enum, Boolean, ...), or a
    client-side default of a column the rows leave out.
    """
    dialect = connection.dialect
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        return False
    keys = tuple(rows[0])
    if any(len(row) != len(keys) or row.keys() != rows[0].keys() for row in rows):
        return False
    sql = _unnest_sql(table, keys, dialect)
    if sql is None:
        return False
    connection.exec_driver_sql(
        sql, {f"p{i}": [row[key] for row in rows] for i, key in enumerate(keys)}
    )
    return True


@lru_cache(maxsize=256)
def _unnest_sql(table: Table, keys: Sequence[str], dialect: Dialect) -> str | None:
    """The unnest INSERT of ``keys`` into ``table``; None when a column does not fit."""
    columns = []
    arrays = []
    for index, key in enumerate(keys):
        column = table.c.get(key)
        array = None if column is None else _array_type(column.type, dialect)
        if column is None or array is None:
            return None
        columns.append(column)
        arrays.append(f"%(p{index})b::{array}[]")
    if any(column.key not in keys and column.default is not None for column in table.c):
        return None  # SQLAlchemy fills that default in on the client
    prepare = dialect.identifier_preparer
    names = ", ".join(prepare.format_column(column) for column in columns)
    return (
        f"INSERT INTO {prepare.format_table(table)} ({names}) "
        f"SELECT * FROM unnest({', '.join(arrays)})"
    )


def _array_type(column_type: Any, dialect: Dialect) -> str | None:
    """The array element type for ``column_type``; None: let SQLAlchemy write it."""
    if isinstance(column_type, LargeBinary):
        return "bytea"  # its bind processor only wraps the bytes for the driver
    if isinstance(column_type, Enum) or column_type._cached_bind_processor(dialect) is not None:
        return None
    if isinstance(column_type, DateTime):
        return "timestamptz" if column_type.timezone else "timestamp"
    return next((name for kind, name in _ARRAY_TYPES if isinstance(column_type, kind)), None)


def staged_writes(session: Session) -> StagedWrites | None:
    """The stage of ``session``'s current transaction (None outside the processor)."""
    staged: StagedWrites | None = session.info.get(_STAGED_KEY)
    return staged


def open_stage(session: Session, *, immediate: bool) -> StagedWrites:
    """Give ``session``'s transaction a fresh stage (the processor, before the handlers)."""
    staged = StagedWrites(session, immediate=immediate)
    session.info[_STAGED_KEY] = staged
    return staged


def close_stage(session: Session) -> None:
    """Forget ``session``'s stage (the transaction is over)."""
    session.info.pop(_STAGED_KEY, None)
