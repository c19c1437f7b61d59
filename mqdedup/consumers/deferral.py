"""Deferred writes: the plain ``ctx.session.execute(insert(t), row)`` handler, set-based.

During a batch's handlers, ``ctx.session.execute()`` of a Core ``insert()`` /
``update()`` / ``delete()`` without ``RETURNING`` (what ``ctx.stage`` accepts) is not
sent at once: it is queued and returns a :class:`DeferredResult`. The queue is written
with the rows of one statement together (``unnest`` for a plain ``insert(table)`` on
PostgreSQL, an executemany otherwise): a write joins the last run of its statement
only past runs on other tables with no foreign key between them, so the order per
table and between linked tables is kept. It is written when

* anything else is executed on the transaction's connection (a SELECT, ``text()``, an
  ORM flush, a savepoint, driver SQL through ``ctx.session.connection()``, the outbox
  writer's insert): reads see every earlier write, as without deferral;
* a handler reads a deferred result (``rowcount``, ``inserted_primary_key``, rows,
  ``scalar()``, ...): its own writes are then executed one by one, so it reads the
  real result of its statement;
* the batch's handlers are done, before the results are stored and the commit.

A handler inside a savepoint of its own (``ctx.session.begin_nested()``) is not
deferred: an error it catches there stays its own business, as without deferral.

A deferred write that fails cannot be traced to its message (it runs later, with
others): the processor rolls the transaction back and runs the batch again with every
statement executed at once, inside its handler's failure boundary, so the culprit fails
alone. What a handler sends around SQLAlchemy (a DBAPI cursor of its own) is not seen:
write through ``ctx.session``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, Table, event
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Delete, Insert, Update

from mqdedup.consumers.staging import insert_unnest


class DeferredResultUnavailableError(RuntimeError):
    """A deferred write's result was read after it had been written with others'
    (e.g. kept from one handler call to the next): there is no result of its own."""


class _Write:
    """One deferred statement execution."""

    __slots__ = ("handler", "key", "params", "result", "statement", "table", "target")

    def __init__(
        self,
        statement: Insert | Update | Delete,
        key: Any,
        table: Table | None,
        target: Table | None,
        params: dict[str, Any],
        handler: int,
    ) -> None:
        self.statement = statement
        self.key = key
        self.table = table  # a plain insert(table): may go as one unnest INSERT
        self.target = target  # the table it writes (None: not a plain Table)
        self.params = params
        self.handler = handler  # the handler call that made it
        self.result: Any = None  # its own result, once executed on its own


class DeferredResult:
    """Stands in for the result of a deferred write: reading it executes the write.

    Any attribute, iteration or ``with`` first writes everything still queued (in
    order), the current handler's statements one by one, then answers from this
    statement's real result.
    """

    __slots__ = ("_result", "_write", "_writes")

    def __init__(self, writes: DeferredWrites, write: _Write) -> None:
        self._writes = writes
        self._write = write
        self._result: Any = None

    def _resolve(self) -> Any:
        if self._result is None:
            self._result = self._writes.result_of(self._write)
        return self._result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resolve(), name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._resolve())

    def __enter__(self) -> Any:
        return self._resolve().__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        return self._resolve().__exit__(*exc_info)


class DeferredWrites:
    """The writes a transaction's handlers deferred, in order.

    ``failed`` holds the error of a write that failed when written: the transaction
    cannot be trusted any more, the processor reruns the batch without deferral.
    """

    def __init__(self, session: Session, connection: Connection) -> None:
        self.session = session
        #: The transaction's connection (asking the session for it can fail while it
        #: is opening or closing a savepoint, when the queue may be written).
        self.connection = connection
        self.failed: Exception | None = None
        self._pending: list[_Write] = []
        self._flushing = False
        self._handler = 0  # the current handler call (0: none)
        self._handlers = 0
        #: Statement objects seen, by id (held, so an id is not reused in this batch).
        self._seen: dict[int, tuple[Any, Any, Table | None, Table | None]] = {}
        self._session_execute = Session.execute
        self.hook: _Hook | None = None  # the connection's listener (open_deferral)

    def __len__(self) -> int:
        return len(self._pending)

    # -- the handler side --------------------------------------------------------------

    def execute(self, statement: Any, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``ctx.session.execute`` while deferring: queue a deferrable write, else
        write the queue and execute ``statement`` at once."""
        if not args and not kwargs and (params is None or isinstance(params, Mapping)):
            deferred = self._defer(statement, params)
            if deferred is not None:
                return deferred
        return self._session_execute(self.session, statement, params, *args, **kwargs)

    def _defer(self, statement: Any, params: Mapping[str, Any] | None) -> DeferredResult | None:
        if self.failed is not None or self._handler == 0:
            return None
        seen = self._seen.get(id(statement))
        if seen is None:
            seen = (statement, *_deferrable(statement))
            self._seen[id(statement)] = seen
        key = seen[1]
        if key is None or self.session.in_nested_transaction():
            return None
        write = _Write(statement, key, seen[2], seen[3], dict(params or {}), self._handler)
        self._pending.append(write)
        return DeferredResult(self, write)

    def result_of(self, write: _Write) -> Any:
        """The real result of ``write`` (written now, with everything before it)."""
        self.flush()
        if write.result is None:
            error = DeferredResultUnavailableError(
                "the result of a deferred ctx.session.execute() was read after it had "
                "been written together with other handlers' writes; the batch runs again "
                "with every statement executed at once"
            )
            self.failed = self.failed or error
            raise error
        return write.result

    # -- the processor side ------------------------------------------------------------

    def enter_handler(self) -> None:
        """A handler call starts: its writes are its own until it returns."""
        self._handlers += 1
        self._handler = self._handlers

    def leave_handler(self) -> None:
        """The handler call is over (its writes may now go with others')."""
        self._handler = 0

    def flush(self) -> None:
        """Write the queue in order: runs of one statement set-based, the current
        handler's writes one by one (it may read their results)."""
        if self._flushing or not self._pending:
            return
        pending, self._pending = self._pending, []
        self._flushing = True
        try:
            connection = self.connection
            runs: list[list[_Write]] = []
            own: list[_Write] = []  # the current handler's (always the queue's end)
            for write in pending:
                if write.handler == self._handler:
                    own.append(write)
                else:
                    _place(runs, write)
            for run in runs:
                self._write_run(connection, run)
            for write in own:
                write.result = connection.execute(write.statement, write.params)
        except Exception as error:
            self.failed = self.failed or error
            raise
        finally:
            self._flushing = False

    @staticmethod
    def _write_run(connection: Connection, run: list[_Write]) -> None:
        if not run:
            return
        rows = [write.params for write in run]
        table = run[0].table
        if table is not None and len(rows) > 1 and insert_unnest(connection, table, rows):
            return
        statement = run[0].statement
        if len(rows) > 1:
            connection.execute(statement, rows)
        elif isinstance(statement, Insert) and not statement._inline:
            # Nobody reads its result: no implicit RETURNING of the generated key.
            connection.execute(statement.inline(), rows[0])
        else:
            connection.execute(statement, rows[0])

    def take_plain_inserts(self) -> list[tuple[Table, dict[str, Any]]] | None:
        """Hand over the queue when it holds only plain ``insert(table)`` writes, each
        as its table and row, to be written by the caller (the queue is then empty);
        None (the queue kept) when another kind of write is queued."""
        pending = self._pending
        rows: list[tuple[Table, dict[str, Any]]] = []
        for write in pending:
            if write.table is None:
                return None
            rows.append((write.table, write.params))
        self._pending = []
        return rows

    # -- the connection hook ----------------------------------------------------------

    def before_statement(self) -> None:
        """Anything is about to run on the connection: write the queue first."""
        if self._pending and not self._flushing:
            self.flush()


#: Statement execution options that change nothing about when the statement may run.
_HARMLESS_OPTIONS = frozenset({"preserve_rowcount"})


#: How many runs back a write may join a run of its statement.
_REACH = 8


def _place(runs: list[list[_Write]], write: _Write) -> None:
    """Add ``write`` to the last run of its statement if it may move before the runs
    after that one (they write other tables, not linked by a foreign key), else start
    a run. Order is kept where it can matter: per table, and between linked tables."""
    for run in runs[: -_REACH - 1 : -1]:
        first = run[0]
        if first.key == write.key:
            run.append(write)
            return
        if _depends(first.target, write.target):
            break
    runs.append([write])


@lru_cache(maxsize=1024)
def _depends(one: Table | None, other: Table | None) -> bool:
    """True when writes to ``one`` and ``other`` may see each other (same table, a
    foreign key between them, or a table we cannot tell)."""
    if one is None or other is None or one is other:
        return True
    try:
        keys = (*one.foreign_keys, *other.foreign_keys)
        return any(key.column.table in (one, other) for key in keys)
    except Exception:  # a foreign key to a table this metadata does not know
        return True


def _deferrable(statement: Any) -> tuple[Any, Table | None, Table | None]:
    """The run key of a deferrable write (None: execute it at once), its table when it
    is a plain ``insert(table)``, and the table it writes."""
    if not isinstance(statement, Insert | Update | Delete):
        return None, None, None
    if type(statement) is Insert and len(statement.__dict__) == 1:
        # A fresh ``insert(table)`` and nothing else (every generative call sets an
        # attribute): known without building its cache key, the handler's usual case.
        table = statement.table
        if isinstance(table, Table):
            plain = _plain_insert(table)
            if plain is not None:
                return plain, table, table
    if (
        statement._returning
        or statement._return_defaults
        or statement._propagate_attrs.get("compile_state_plugin") == "orm"
        or any(option not in _HARMLESS_OPTIONS for option in statement._execution_options)
    ):
        return None, None, None
    target = statement.table if isinstance(statement.table, Table) else None
    cache_key = statement._generate_cache_key()
    if cache_key is None or any(not bind.required for bind in cache_key.bindparams):
        return ("own", id(statement)), None, target  # values built in: a run of its own
    key = ("sql", cache_key.key)
    if isinstance(statement, Insert) and target is not None and key == _plain_insert(target):
        return key, target, target
    return key, None, target


@lru_cache(maxsize=256)
def _plain_insert(table: Table) -> Any:
    cache_key = table.insert()._generate_cache_key()
    return None if cache_key is None else ("sql", cache_key.key)


class _Hook:
    """Listens to one connection's statements for the deferral of its transaction."""

    __slots__ = ("writes",)

    def __init__(self) -> None:
        self.writes: DeferredWrites | None = None

    def before_cursor_execute(self, *_args: Any) -> None:
        writes = self.writes
        if writes is not None:
            writes.before_statement()


_HOOK = "_mqdedup_deferral_hook"


def open_deferral(session: Session, connection: Connection | None = None) -> DeferredWrites:
    """Defer the writes of ``session``'s transaction; its connection writes the queue
    before any other statement (the listener is installed once per connection).

    ``connection``: the one the session is bound to, when it is known (asking the
    session for it would begin the session's transaction).
    """
    if connection is None:
        connection = session.connection()
    writes = DeferredWrites(session, connection)
    hook: _Hook | None = connection.__dict__.get(_HOOK)
    if hook is None:
        hook = _Hook()
        event.listen(connection, "before_cursor_execute", hook.before_cursor_execute)
        connection.__dict__[_HOOK] = hook
    hook.writes = writes
    writes.hook = hook
    return writes


def close_deferral(writes: DeferredWrites) -> None:
    """Stop listening for ``writes`` (the transaction is over)."""
    hook = writes.hook
    if hook is not None and hook.writes is writes:
        hook.writes = None
