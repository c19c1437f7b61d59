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

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Delete, Insert, Update

#: What ``ctx.stage`` accepts: a table (an INSERT of the row) or a DML statement.
Stageable = Table | Insert | Update | Delete

_STAGED_KEY = "mqdedup.staged"


class StagedWriteError(TypeError):
    """``ctx.stage`` was given something it cannot run set-based (the handler's bug)."""


class _Group:
    """One statement and the rows staged for it."""

    __slots__ = ("rows", "statement")

    def __init__(self, statement: Insert | Update | Delete) -> None:
        self.statement = statement
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

    def __len__(self) -> int:
        return len(self._journal)

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
        group.rows.append(row)
        self._journal.append(group)

    def mark(self) -> int:
        """A point to :meth:`undo` to (before a handler that may fail in a savepoint)."""
        return len(self._journal)

    def undo(self, mark: int) -> None:
        """Drop the rows staged after ``mark`` (their handler failed)."""
        while len(self._journal) > mark:
            self._journal.pop().rows.pop()

    def flush(self) -> None:
        """Run every staged statement once with its rows; empty the stage."""
        groups = [group for group in self._groups.values() if group.rows]
        self._groups.clear()
        self._seen.clear()
        self._journal.clear()
        if not groups:
            return
        connection: Connection = self.session.connection()
        for group in groups:
            rows = group.rows
            connection.execute(group.statement, rows if len(rows) > 1 else rows[0])

    def _group(self, target: Stageable) -> _Group:
        seen = self._seen.get(id(target))
        key = seen[1] if seen is not None else self._key(target)
        group = self._groups.get(key)
        if group is None:
            statement = target.insert() if isinstance(target, Table) else target
            group = self._groups[key] = _Group(statement)
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
