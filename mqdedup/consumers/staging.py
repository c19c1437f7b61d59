"""Staged writes: per-message handlers whose inserts and updates run set-based per batch.

A handler calls ``ctx.stage(orders, {...})`` (a table: one INSERT row) or
``ctx.stage(statement, {...})`` (an INSERT / UPDATE / DELETE with bind parameters)
instead of executing the statement itself. The unit of work collects the rows and,
after the batch's last handler and before the results are stored and the transaction
commits, executes each statement once with all its rows.

What it means, exactly:

* **When.** Staged statements run after all handlers of the batch, grouped by statement
  object (one ``Table``, or one statement built once, e.g. at module level) and by the
  row's set of keys; the groups in the order of their first use, the rows of a group in
  the order they were staged. A handler does not see its staged rows; write what a later
  read needs with ``ctx.session``. A statement built anew in every call is a group of
  its own: it is exact, but it is not set-based.
* **Values.** Each row is captured when it is staged (a copy; mutable values deeply),
  so a handler may reuse and change its dict. Rows with different keys are separate
  executemany groups, so no column of a later row is dropped.
* **Writing.** A group is written by SQLAlchemy's executemany, the way
  ``ctx.session.execute(statement, rows)`` writes it. On PostgreSQL with psycopg, a
  table's group whose every value already has the Python type of its column (``str``
  for text, ``int`` for integers, ...) goes as one ``INSERT … SELECT FROM unnest(…)``
  instead: the same rows, several times cheaper. Anything else (a list for a text
  column, a ``bool`` for an integer one, a column type with its own bind processing)
  takes SQLAlchemy's path, which writes or refuses it as an immediate execute would.
* **Failures.** The unit of work writes the stage in a savepoint; when it fails, each
  message's rows are written again alone, in staging order, to find the messages they
  belong to (see :mod:`mqdedup.consumers.transactions`).
"""

from __future__ import annotations

import copy
import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from decimal import Decimal
from enum import Enum as PyEnum
from functools import lru_cache
from typing import Any

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

#: What ``ctx.stage`` accepts: a table (an INSERT of the row) or a DML statement.
Stageable = Table | Insert | Update | Delete

#: Values that cannot change after they are staged (everything else is deep-copied).
_IMMUTABLE = (
    str,
    int,
    float,
    bytes,
    Decimal,
    dt.date,
    dt.time,
    dt.timedelta,
    uuid.UUID,
    PyEnum,
    type(None),
)

_STAGED_KEY = "mqdedup.staged"


class StagedWriteError(TypeError):
    """``ctx.stage`` was given something it cannot stage (the handler's bug)."""


class _Group:
    """One statement, one set of keys, and the rows staged for them."""

    __slots__ = ("rows", "statement", "table", "target")

    def __init__(self, target: Stageable) -> None:
        self.target = target  # held: its id() keys this group for the stage's life
        self.table = target if isinstance(target, Table) else None
        self.statement: Insert | Update | Delete = (
            target.insert() if isinstance(target, Table) else target
        )
        self.rows: list[dict[str, Any]] = []


class StagedWrites:
    """The rows a transaction's handlers staged, grouped, in first-use order.

    ``owner`` is set by the unit of work before each handler call: every row staged
    meanwhile belongs to it (None: the batch handler's), so a failing row can be traced
    to its message.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, tuple[str, ...]], _Group] = {}
        #: Every staged row in staging order: its group, its values, its owner.
        self._journal: list[tuple[_Group, dict[str, Any], Any]] = []
        self.owner: Any = None

    def __len__(self) -> int:
        return len(self._journal)

    def add(self, target: Stageable, row: Mapping[str, Any]) -> None:
        """Stage a copy of ``row`` for ``target``."""
        values = capture(target, row)
        key = (id(target), tuple(values))
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(target)
        group.rows.append(values)
        self._journal.append((group, values, self.owner))

    def mark(self) -> int:
        """A point to :meth:`undo` to (before a handler that may fail in a savepoint)."""
        return len(self._journal)

    def undo(self, mark: int) -> None:
        """Drop the rows staged after ``mark`` (their handler failed)."""
        while len(self._journal) > mark:
            group, _values, _owner = self._journal.pop()
            group.rows.pop()

    def owners(self) -> list[Any]:
        """The owners of staged rows, each once, in the order of their first row."""
        seen: dict[int, Any] = {}
        for _group, _values, owner in self._journal:
            seen.setdefault(id(owner), owner)
        return list(seen.values())

    def flush(self, connection: Connection) -> None:
        """Run every group once with its rows, in the order of first use."""
        for group in self._groups.values():
            rows = group.rows
            if not rows:
                continue
            table = group.table
            if table is not None and len(rows) > 1 and insert_unnest(connection, table, rows):
                continue
            connection.execute(group.statement, rows if len(rows) > 1 else rows[0])

    def write_alone(self, connection: Connection, owner: Any) -> None:
        """Run ``owner``'s rows one statement at a time, in staging order."""
        for group, values, row_owner in self._journal:
            if row_owner is owner:
                connection.execute(group.statement, values)


def capture(target: Stageable, row: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``row`` as it is now, after checking that it can be staged."""
    if isinstance(target, Insert | Update | Delete):
        if len(target.exported_columns):
            raise StagedWriteError(
                "ctx.stage() cannot run a statement with RETURNING: staged rows are "
                "written at the batch end and nothing reads their results; execute it "
                "with ctx.session.execute() instead"
            )
    elif not isinstance(target, Table):
        raise StagedWriteError(
            "ctx.stage() takes a Table (one INSERT row) or an insert() / update() / "
            f"delete() statement, not {type(target).__name__}"
        )
    if not isinstance(row, Mapping):
        raise StagedWriteError(
            f"ctx.stage() takes one row as a mapping of column names to values, "
            f"not {type(row).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in row.items():
        if not isinstance(key, str):
            raise StagedWriteError(
                f"ctx.stage() takes column names as str keys, not {type(key).__name__}: {key!r}"
            )
        values[key] = value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)
    return values


def insert_unnest(connection: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> bool:
    """PostgreSQL (psycopg): a table's rows as one ``INSERT … SELECT FROM unnest(…)``.

    One statement with one binary array per column, as a bulk handler would write it.
    False (nothing written) whenever the result could differ from SQLAlchemy's own
    executemany: another database or driver, a column type with bind processing
    (JSON, Enum, Boolean, ...), a client-side default of a column the rows leave out,
    or any value whose Python type is not exactly the one its column's array holds.
    """
    dialect = connection.dialect
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        return False
    keys = tuple(rows[0])
    plan = _unnest_plan(table, keys, dialect)
    if plan is None:
        return False
    sql, accepted = plan
    arrays: dict[str, list[Any]] = {}
    for index, (key, kinds) in enumerate(zip(keys, accepted, strict=True)):
        column = [row[key] for row in rows]
        if not _uniform(column, kinds):
            return False
        arrays[f"p{index}"] = column
    connection.exec_driver_sql(sql, arrays)
    return True


def _uniform(values: list[Any], kinds: tuple[type[Any], ...]) -> bool:
    """True when every value is None or of exactly one of ``kinds``, all of the same type.

    Exact types: a ``bool`` is not an ``int`` here, a ``datetime`` not a ``date``, and a
    list never a scalar, so psycopg dumps the array as the column's own type (naive and
    aware datetimes are not mixed either).
    """
    seen: Any = None
    for value in values:
        if value is None:
            continue
        kind = type(value)
        if kind not in kinds:
            return False
        # naive and aware datetimes are dumped as different types: never mix them
        shape = (kind, value.tzinfo is None) if kind is dt.datetime else kind
        if seen is not None and shape != seen:
            return False
        seen = shape
    return True


#: The array type each column type travels in (the base type without length or
#: precision, so the INSERT's own assignment cast checks the values: an explicit cast to
#: ``varchar(n)`` would cut a long string instead of refusing it), and the Python types
#: its values must have.
_ARRAYS: tuple[tuple[type[Any], str, tuple[type[Any], ...]], ...] = (
    (LargeBinary, "bytea", (bytes,)),
    (String, "text", (str,)),
    (Integer, "bigint", (int,)),
    (Float, "float8", (float,)),
    (Numeric, "numeric", (Decimal,)),
    (Date, "date", (dt.date,)),
    (Uuid, "uuid", (uuid.UUID,)),
)


@lru_cache(maxsize=256)
def _unnest_plan(
    table: Table, keys: tuple[str, ...], dialect: Dialect
) -> tuple[str, tuple[tuple[type[Any], ...], ...]] | None:
    """The unnest INSERT of ``keys`` into ``table`` and each column's accepted Python
    types; None when a column does not fit."""
    columns = []
    arrays = []
    accepted = []
    for index, key in enumerate(keys):
        column = table.c.get(key)
        fit = None if column is None else _array_type(column.type, dialect)
        if column is None or fit is None:
            return None
        columns.append(column)
        arrays.append(f"%(p{index})b::{fit[0]}[]")
        accepted.append(fit[1])
    if any(column.key not in keys and column.default is not None for column in table.c):
        return None  # SQLAlchemy fills that default in on the client
    prepare = dialect.identifier_preparer
    names = ", ".join(prepare.format_column(column) for column in columns)
    sql = (
        f"INSERT INTO {prepare.format_table(table)} ({names}) "
        f"SELECT * FROM unnest({', '.join(arrays)})"
    )
    return sql, tuple(accepted)


def _array_type(column_type: Any, dialect: Dialect) -> tuple[str, tuple[type[Any], ...]] | None:
    """The array element type and accepted Python types for ``column_type``; None: let
    SQLAlchemy write it."""
    if isinstance(column_type, Enum):
        return None
    processor = column_type.dialect_impl(dialect).bind_processor(dialect)
    if processor is not None and not isinstance(column_type, LargeBinary):
        return None  # LargeBinary's processor only wraps the bytes for the driver
    if isinstance(column_type, DateTime):
        return ("timestamptz" if column_type.timezone else "timestamp"), (dt.datetime,)
    for kind, name, accepted in _ARRAYS:
        if isinstance(column_type, kind):
            return name, accepted
    return None


def staged_writes(session: Session) -> StagedWrites | None:
    """The stage of ``session``'s current transaction (None outside the processor)."""
    staged: StagedWrites | None = session.info.get(_STAGED_KEY)
    return staged


def open_stage(session: Session) -> StagedWrites:
    """Give ``session``'s transaction a fresh stage (the unit of work, before the handlers)."""
    staged = StagedWrites()
    session.info[_STAGED_KEY] = staged
    return staged


def close_stage(session: Session) -> None:
    """Forget ``session``'s stage (the transaction is over)."""
    session.info.pop(_STAGED_KEY, None)
