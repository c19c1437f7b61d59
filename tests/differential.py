"""The differential suite of issue 28: generated handler programs, run through mqdedup and
through a reference written by hand, must end the same (DESIGN.md promise 8).

A *scenario* is a batch of messages (some delivered more than once) and, for each
message, a *program*: a list of operations its handler performs through ``ctx.session``
and ``ctx.stage`` (Core inserts with varying key sets, updates and deletes with
``bindparam``, ``insert().from_select``, scalar subqueries, ORM ``add`` followed by a
Core write of that row, reads whose values feed later writes and the result, parameter
dicts, executemany lists and nested JSON values the handler reuses and mutates after the
call, a list for a Text column, a NULL for a NOT NULL one, raises on every call or on the
first ``k`` calls, staged inserts with varying key sets (some failing, some mutated after
staging) and staged commutative updates).

:func:`run_framework` publishes the deliveries to an :class:`~mqdedup.InMemoryBroker`
and runs a consumer over them (any ``failure_isolation``; ``handle`` or ``handle_batch``
style). :func:`run_reference` runs the same programs with plain SQLAlchemy and no
mqdedup: each message's statements at once, in delivery order, each message in its own
transaction; a message that raises is rolled back and retried after its batch-mates,
in delivery order, until ``RetryPolicy.max_attempts`` failed attempts (counted across
deliveries, as mqdedup counts them in the database), then dead-lettered; a copy of a
processed message is a duplicate (``on_duplicate`` gets the stored result); a copy in the
same batch as its first delivery shares that delivery's fate. :func:`differences` lists
what differs: every row of every business table, the stored results, the dead letters
with their attempt counts, the ``on_duplicate`` calls and the messages ``after_commit``
saw.

``ctx.stage``'s documented order (staged rows written after all the batch's handlers,
per statement and key set, groups in order of first use) is kept out of the comparison
by construction: staged inserts go to a table no handler reads or updates, with ids of
their own, and staged updates add to counters (commutative). The reference writes a
staged row at the call. Handler call counts (which depend on the isolation mode) are
used only for "raise on the first k calls".

Used by ``tests/unit/test_differential.py`` (SQLite),
``tests/integration/test_differential_pg.py`` (PostgreSQL, MariaDB) and
``bench/differential_soak.py`` (thousands of examples).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, ClassVar, cast

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from sqlalchemy import (
    JSON,
    Column,
    CursorResult,
    Engine,
    Integer,
    MetaData,
    Result,
    String,
    Table,
    Text,
    bindparam,
    delete,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.orm import Session, registry
from sqlalchemy.sql.dml import Delete, Insert, Update

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy, StopToken, Worker
from mqdedup.consumers.context import BatchContext
from mqdedup.db import init_schema
from mqdedup.db.schema import schema

QUEUE = "differential"
MAX_ATTEMPTS = 3
RETRY = RetryPolicy(
    max_attempts=MAX_ATTEMPTS,
    initial_backoff=0.0,
    max_backoff=0.0,
    jitter=0.0,
    infrastructure_backoff_max=0.2,
)
ISOLATIONS = ("auto", "savepoint", "rerun", "transaction")
STYLES = ("handle", "handle_batch")
#: Seconds one framework run may take before it is stopped and reported as stuck.
RUN_TIMEOUT = 60.0
SEED_ITEMS = {1: (10, "seed-1"), 2: (20, None), 3: (30, "seed-3")}
COUNTERS = (1, 2, 3)
NOTES = ("keep-me", "x", "ünïcødé", None)


class PlannedFailure(RuntimeError):
    """What a program's ``Raise`` operation raises."""


# -- the business tables -------------------------------------------------------------------


class ItemBase:
    """The ORM class of ``items`` (one mapped subclass per table prefix)."""

    def __init__(self, **values: Any) -> None:
        for key, value in values.items():
            setattr(self, key, value)


@dataclass(frozen=True)
class Tables:
    """The business tables of one prefix and the statements handlers share.

    A statement object shared by every handler call (``insert_item``, ``update_item``,
    ...) is what a framework grouping writes per statement would group; programs also
    build fresh statements (``insert(items).values(...)``, ``from_select``).
    """

    prefix: str
    metadata: MetaData
    items: Table
    ledger: Table
    copies: Table
    staged: Table
    counters: Table
    item_class: type[ItemBase]
    insert_item: Insert
    #: ``UPDATE items SET <the parameters' other keys> WHERE id = :b_id``.
    update_item: Update
    bump_item: Update
    delete_item: Delete
    count_ledger_into_item: Update
    staged_insert: Insert
    stage_counter: Update

    @property
    def business(self) -> tuple[Table, ...]:
        """The tables compared, in a fixed order."""
        return (self.items, self.ledger, self.copies, self.staged, self.counters)


@cache
def business_tables(prefix: str) -> Tables:
    """The business tables for ``prefix`` (built once per prefix)."""
    metadata = MetaData()
    items = Table(
        f"{prefix}items",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("qty", Integer, nullable=False),
        Column("note", Text, nullable=True),
        Column("tag", String(40), nullable=True),
        Column("data", JSON, nullable=True),
    )
    ledger = Table(
        f"{prefix}ledger",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("msg", String(64), nullable=False),
        Column("amount", Integer, nullable=False),
        Column("balance", Integer, nullable=False),
    )
    copies = Table(
        f"{prefix}copies",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("total", Integer, nullable=False),
        Column("source", String(64), nullable=False),
    )
    # Written by ctx.stage only, read by no handler.
    staged = Table(
        f"{prefix}staged",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("msg", String(64), nullable=False),
        Column("val", Integer, nullable=True),
        Column("note", Text, nullable=True),
        Column("data", JSON, nullable=True),
    )
    # Added to by staged updates only (commutative), read by no handler.
    counters = Table(
        f"{prefix}counters",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("n", Integer, nullable=False),
    )
    item_class = type(f"Item_{prefix or 'default'}", (ItemBase,), {})
    registry().map_imperatively(item_class, items)
    by_id = items.c.id == bindparam("b_id")
    return Tables(
        prefix=prefix,
        metadata=metadata,
        items=items,
        ledger=ledger,
        copies=copies,
        staged=staged,
        counters=counters,
        item_class=item_class,
        insert_item=insert(items),
        update_item=update(items).where(by_id),
        bump_item=update(items).where(by_id).values(qty=items.c.qty + bindparam("b_inc")),
        delete_item=delete(items).where(by_id),
        count_ledger_into_item=update(items)
        .where(by_id)
        .values(qty=select(func.count()).select_from(ledger).scalar_subquery()),
        staged_insert=insert(staged),
        stage_counter=update(counters)
        .where(counters.c.id == bindparam("b_cid"))
        .values(n=counters.c.n + bindparam("b_inc")),
    )


def create_tables(engine: Engine, prefix: str) -> Tables:
    """Create the framework's tables and the business tables under ``prefix``."""
    tables = business_tables(prefix)
    init_schema(engine, prefix)
    tables.metadata.create_all(engine)
    return tables


def drop_tables(engine: Engine, prefix: str) -> None:
    """Drop what :func:`create_tables` created."""
    business_tables(prefix).metadata.drop_all(engine)
    schema(prefix).metadata.drop_all(engine)


def reset(engine: Engine, tables: Tables) -> None:
    """Empty the business tables and put the seed rows back."""
    with engine.begin() as connection:
        for table in reversed(tables.business):
            connection.execute(delete(table))
        connection.execute(
            insert(tables.items),
            [{"id": key, "qty": qty, "note": note} for key, (qty, note) in SEED_ITEMS.items()],
        )
        connection.execute(insert(tables.counters), [{"id": key, "n": 0} for key in COUNTERS])


def snapshot(engine: Engine, tables: Tables) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every business table, by table (without the prefix), ordered by id."""
    with engine.connect() as connection:
        return {
            table.name.removeprefix(tables.prefix): [
                tuple(row) for row in connection.execute(select(table).order_by(table.c.id))
            ]
            for table in tables.business
        }


# -- programs ---------------------------------------------------------------------------------

Extra = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class InsertItem:
    """Insert an item; ``extra`` optional columns (key sets vary between rows).

    ``style``: ``params`` (the shared ``insert(items)`` with a dict), ``values``
    (``insert(items).values(...)``), ``many`` (the shared statement with two rows).
    """

    id: int
    qty: int
    extra: Extra = ()
    style: str = "params"
    qty_from_read: bool = False


@dataclass(frozen=True)
class UpdateItem:
    """``update(items).where(id == bindparam('b_id'))`` with a SET from the keys given."""

    target: int
    sets: Extra
    qty_from_read: bool = False


@dataclass(frozen=True)
class BumpItem:
    """``qty = qty + :b_inc`` for one item (rowcount recorded)."""

    target: int
    inc: int


@dataclass(frozen=True)
class DeleteItem:
    """Delete one item by bindparam (rowcount recorded)."""

    target: int


@dataclass(frozen=True)
class CopyTotal:
    """``insert(copies).from_select(...)``: the sum of all quantities, now."""

    id: int


@dataclass(frozen=True)
class LedgerEntry:
    """A running balance: ``form`` ``scalar`` (a scalar subquery in VALUES) or
    ``select`` (``insert().from_select``) over the ledger itself."""

    id: int
    amount: int
    form: str = "scalar"


@dataclass(frozen=True)
class CountLedgerInto:
    """``UPDATE items SET qty = (SELECT count(*) FROM ledger) WHERE id = :b_id``."""

    target: int


@dataclass(frozen=True)
class OrmAdd:
    """``session.add(Item(...))``, maybe ``flush()``, then ``then`` of that row by Core
    (``update``, ``delete`` or ``none``; rowcount recorded)."""

    id: int
    qty: int
    then: str = "none"
    flush: bool = False


@dataclass(frozen=True)
class Read:
    """A read whose value goes to the result and feeds ``*_from_read`` writes.

    ``kind``: ``sum`` (of all quantities), ``item`` (``target``'s qty and note),
    ``ledger`` (entries and last balance)."""

    kind: str
    target: int = 0


@dataclass(frozen=True)
class ReuseDict:
    """One parameter dict executed once per quantity, mutated in between and after.

    ``shared``: the dict is kept across handler calls (only ``id`` and ``qty`` set)."""

    id: int
    qtys: tuple[int, ...]
    shared: bool = False


@dataclass(frozen=True)
class ReuseRows:
    """An executemany of rows whose dicts the handler mutates afterwards."""

    id: int
    qtys: tuple[int, ...]


@dataclass(frozen=True)
class Raise:
    """Raise :class:`PlannedFailure`: always (``k`` None) or in the first ``k`` attempts."""

    k: int | None = None


@dataclass(frozen=True)
class OddWrite:
    """A write through ``ctx.session`` a database may refuse: ``null`` (a NULL for a
    NOT NULL column: always refused) or ``list`` (a Python list for a Text column:
    whatever the driver does with it, executed at once)."""

    id: int
    kind: str


@dataclass(frozen=True)
class StageRow:
    """``ctx.stage(staged, row)`` (``target`` ``table``) or ``ctx.stage(insert(staged),
    row)`` (``statement``); ``bad``: a NULL ``msg`` (NOT NULL); ``mutate``: the dict is
    changed after staging (must change nothing)."""

    id: int
    extra: Extra = ()
    target: str = "table"
    bad: bool = False
    mutate: bool = False


@dataclass(frozen=True)
class StageCounter:
    """``ctx.stage(update(counters) ... n = n + :b_inc, {...})``."""

    counter: int
    inc: int


Op = (
    InsertItem
    | UpdateItem
    | BumpItem
    | DeleteItem
    | CopyTotal
    | LedgerEntry
    | CountLedgerInto
    | OrmAdd
    | Read
    | ReuseDict
    | ReuseRows
    | Raise
    | OddWrite
    | StageRow
    | StageCounter
)


@dataclass(frozen=True)
class Program:
    """One message's handler: its operations; ``returns``: a result (else None)."""

    ops: tuple[Op, ...]
    returns: bool = True


@dataclass(frozen=True)
class Scenario:
    """Messages (their ids and programs), the deliveries (message indexes in publish
    order, copies included) and the consumer's ``batch_size``."""

    ids: tuple[str, ...]
    programs: tuple[Program, ...]
    deliveries: tuple[int, ...]
    batch_size: int

    def program(self, message_id: str) -> Program:
        """The program of ``message_id``."""
        return self.programs[self.ids.index(message_id)]


def payload(number: int) -> dict[str, Any]:
    """A fresh JSON value for a ``data`` column (nested, mutable)."""
    return {"n": number, "tags": [number, "t"]}


# -- running a program --------------------------------------------------------------------

#: How a program stages a row: ``ctx.stage`` in mqdedup, an immediate write in the reference.
Stage = Callable[[Table | Insert | Update | Delete, Mapping[str, Any]], None]


class Interpreter:
    """Runs programs; holds what a handler keeps across calls (the shared dict)."""

    def __init__(self, tables: Tables, scenario: Scenario) -> None:
        self.tables = tables
        self.scenario = scenario
        self.shared_row: dict[str, Any] = {}

    def run(
        self,
        session: Session,
        stage: Stage,
        message_id: str,
        raises: Callable[[int | None], bool],
    ) -> Any:
        """Run ``message_id``'s program; ``raises(k)``: does a ``Raise(k)`` raise now?"""
        program = self.scenario.program(message_id)
        reads: list[Any] = []
        state = {"last": 0}
        for op in program.ops:
            self._op(session, stage, message_id, op, reads, state, raises)
        return {"reads": reads} if program.returns else None

    def _op(
        self,
        session: Session,
        stage: Stage,
        message_id: str,
        op: Op,
        reads: list[Any],
        state: dict[str, int],
        raises: Callable[[int | None], bool],
    ) -> None:
        t = self.tables
        last = state["last"]
        if isinstance(op, InsertItem):
            row = {"id": op.id, "qty": last if op.qty_from_read else op.qty, **values(op.extra)}
            if op.style == "values":
                session.execute(insert(t.items).values(**row))
            elif op.style == "many":
                session.execute(t.insert_item, [row, {**row, "id": op.id + 1}])
            else:
                session.execute(t.insert_item, row)
        elif isinstance(op, UpdateItem):
            params = {"b_id": op.target, **dict(op.sets)}
            if op.qty_from_read:
                params["qty"] = last
            reads.append(rowcount(session.execute(t.update_item, params)))
        elif isinstance(op, BumpItem):
            reads.append(
                rowcount(session.execute(t.bump_item, {"b_id": op.target, "b_inc": op.inc}))
            )
        elif isinstance(op, DeleteItem):
            reads.append(rowcount(session.execute(t.delete_item, {"b_id": op.target})))
        elif isinstance(op, CopyTotal):
            total = select(
                literal(op.id, Integer),
                func.coalesce(func.sum(t.items.c.qty), 0),
                literal(message_id, String),
            )
            session.execute(insert(t.copies).from_select(["id", "total", "source"], total))
        elif isinstance(op, LedgerEntry):
            balance = func.coalesce(func.sum(t.ledger.c.amount), 0) + op.amount
            if op.form == "select":
                session.execute(
                    insert(t.ledger).from_select(
                        ["id", "msg", "amount", "balance"],
                        select(
                            literal(op.id, Integer),
                            literal(message_id, String),
                            literal(op.amount, Integer),
                            balance,
                        ),
                    )
                )
            else:
                session.execute(
                    insert(t.ledger).values(
                        id=op.id,
                        msg=message_id,
                        amount=op.amount,
                        balance=select(balance).scalar_subquery(),
                    )
                )
        elif isinstance(op, CountLedgerInto):
            reads.append(rowcount(session.execute(t.count_ledger_into_item, {"b_id": op.target})))
        elif isinstance(op, OrmAdd):
            session.add(t.item_class(id=op.id, qty=op.qty, note=f"orm {message_id}"))
            if op.flush:
                session.flush()
            if op.then == "update":
                params = {"b_id": op.id, "qty": op.qty + 100}
                reads.append(rowcount(session.execute(t.update_item, params)))
            elif op.then == "delete":
                reads.append(rowcount(session.execute(t.delete_item, {"b_id": op.id})))
        elif isinstance(op, Read):
            value = self._read(session, op)
            reads.append(value)
            if isinstance(value, int):
                state["last"] = value
            elif isinstance(value, list) and isinstance(value[0], int):
                state["last"] = value[0]
        elif isinstance(op, ReuseDict):
            row = self.shared_row if op.shared else {}
            data = row.get("data") or {}  # one nested value, reused as well
            for offset, qty in enumerate(op.qtys):
                row["id"] = op.id + offset
                row["qty"] = qty
                data.clear()
                data.update(payload(qty))
                row["data"] = data
                session.execute(t.insert_item, row)
            row["qty"] = -999  # after the last execute: must change nothing
            data["n"] = -999
            data["tags"].append("mutated")
        elif isinstance(op, ReuseRows):
            rows: list[dict[str, Any]] = [
                {"id": op.id + offset, "qty": qty, "data": payload(qty)}
                for offset, qty in enumerate(op.qtys)
            ]
            session.execute(t.insert_item, rows)
            for row in rows:
                row["qty"] = -1
                row["data"]["n"] = -1
                row["data"]["tags"].append("mutated")
        elif isinstance(op, Raise):
            if raises(op.k):
                raise PlannedFailure(f"planned failure of {message_id} (k={op.k})")
        elif isinstance(op, OddWrite):
            odd: dict[str, Any] = (
                {"id": op.id, "qty": None}
                if op.kind == "null"
                else {"id": op.id, "qty": 1, "note": ["a", "b"]}
            )
            session.execute(t.insert_item, odd)
        elif isinstance(op, StageRow):
            staged_row: dict[str, Any] = {
                "id": op.id,
                "msg": None if op.bad else message_id,
                **values(op.extra),
            }
            stage(t.staged if op.target == "table" else t.staged_insert, staged_row)
            if op.mutate:
                staged_row["val"] = -7
                staged_row["note"] = "mutated after staging"
                if isinstance(staged_row.get("data"), dict):
                    staged_row["data"]["n"] = -7
                    staged_row["data"]["tags"].append("mutated")
        elif isinstance(op, StageCounter):
            stage(t.stage_counter, {"b_cid": op.counter, "b_inc": op.inc})
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"unknown operation {op!r}")

    def _read(self, session: Session, op: Read) -> Any:
        t = self.tables
        if op.kind == "sum":
            total = session.execute(select(func.coalesce(func.sum(t.items.c.qty), 0)))
            return int(total.scalar_one())
        if op.kind == "item":
            row = session.execute(
                select(t.items.c.qty, t.items.c.note).where(t.items.c.id == op.target)
            ).first()
            return None if row is None else [int(row[0]), row[1]]
        entries, balance = session.execute(
            select(func.count(), func.coalesce(func.max(t.ledger.c.balance), 0)).select_from(
                t.ledger
            )
        ).one()
        return [int(entries), int(balance)]


def rowcount(result: Result[Any]) -> int:
    """The rows a DML statement matched (its ``CursorResult.rowcount``)."""
    return cast("CursorResult[Any]", result).rowcount


def values(extra: Extra) -> dict[str, Any]:
    """An operation's optional columns as row values (``data``: a fresh JSON value)."""
    return {
        key: payload(value) if key == "data" and value is not None else value
        for key, value in extra
    }


def raises_until(attempt: int) -> Callable[[int | None], bool]:
    """Whether a ``Raise(k)`` raises in attempt (or call) number ``attempt``."""

    def raises(k: int | None) -> bool:
        return k is None or attempt <= k

    return raises


# -- what a run came to -----------------------------------------------------------------------


@dataclass
class Observed:
    """What one run left behind."""

    tables: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    #: Stored results by message id (None: processed, no result stored).
    results: dict[str, Any] = field(default_factory=dict)
    #: ``(message id, attempts)`` per dead-lettered delivery, sorted.
    dead: list[tuple[str, int]] = field(default_factory=list)
    #: ``(message id, stored result as JSON)`` per ``on_duplicate`` call, sorted.
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    #: Message ids ``after_commit`` was called with, sorted (each processed once).
    committed: list[str] = field(default_factory=list)
    #: The worker's own failure (it raised, or never became idle), if any.
    crash: str | None = None
    #: Dead letters without a reason (message ids): never expected.
    unexplained: list[str] = field(default_factory=list)


def canonical(value: Any) -> str:
    """``value`` as sorted JSON (to compare stored results)."""
    return json.dumps(value, sort_keys=True)


def differences(expected: Observed, actual: Observed) -> list[str]:
    """What differs between the reference and a run, one line per difference."""
    found: list[str] = []
    if actual.crash is not None:
        found.append(f"the worker failed: {actual.crash}")
    if actual.unexplained:
        found.append(f"dead letters without a reason: {actual.unexplained}")
    for name, rows in expected.tables.items():
        got = actual.tables.get(name, [])
        if rows != got:
            missing = [row for row in rows if row not in got]
            extra = [row for row in got if row not in rows]
            found.append(f"table {name}: missing {missing}, unexpected {extra}")
    if expected.results != actual.results:
        keys = sorted(set(expected.results) | set(actual.results))
        diff = {
            key: (expected.results.get(key, "<absent>"), actual.results.get(key, "<absent>"))
            for key in keys
            if expected.results.get(key, "<absent>") != actual.results.get(key, "<absent>")
        }
        found.append(f"stored results (expected, actual): {diff}")
    if expected.dead != actual.dead:
        found.append(f"dead letters (id, attempts): expected {expected.dead}, got {actual.dead}")
    if expected.duplicates != actual.duplicates:
        found.append(f"on_duplicate calls: expected {expected.duplicates}, got {actual.duplicates}")
    if expected.committed != actual.committed:
        found.append(f"after_commit saw {actual.committed}, expected {expected.committed}")
    return found


# -- the reference ----------------------------------------------------------------------------


def batches(scenario: Scenario) -> list[list[int]]:
    """The deliveries' message indexes, batch by batch (all published before the run)."""
    size = scenario.batch_size
    return [
        list(scenario.deliveries[start : start + size])
        for start in range(0, len(scenario.deliveries), size)
    ]


def run_reference(engine: Engine, tables: Tables, scenario: Scenario) -> Observed:
    """The scenario by hand: plain SQLAlchemy sessions, one transaction per attempt."""
    reset(engine, tables)
    interpreter = Interpreter(tables, scenario)
    failures: dict[str, int] = {}
    processed: dict[str, Any] = {}
    observed = Observed()

    def attempt(message_id: str) -> bool:
        number = failures.get(message_id, 0) + 1
        session = Session(engine)

        def stage(target: Table | Insert | Update | Delete, row: Mapping[str, Any]) -> None:
            statement = insert(target) if isinstance(target, Table) else target
            session.execute(statement, dict(row))

        try:
            with session.begin():
                result = interpreter.run(session, stage, message_id, raises_until(number))
        except Exception:
            return False
        finally:
            session.close()
        processed[message_id] = result
        observed.committed.append(message_id)
        return True

    for batch in batches(scenario):
        seen: set[str] = set()
        repeats: list[str] = []
        failed: list[str] = []
        letters: dict[str, int] = {}
        for index in batch:
            message_id = scenario.ids[index]
            if message_id in seen:
                repeats.append(message_id)
                continue
            seen.add(message_id)
            if message_id in processed:
                observed.duplicates.append((message_id, canonical(processed[message_id])))
            elif not attempt(message_id):
                failed.append(message_id)
        for message_id in failed:
            while True:
                failures[message_id] = failures.get(message_id, 0) + 1
                if failures[message_id] >= MAX_ATTEMPTS:
                    letters[message_id] = failures[message_id]
                    observed.dead.append((message_id, failures[message_id]))
                    break
                if attempt(message_id):
                    break
        for message_id in repeats:  # a copy in the batch shares its first copy's fate
            if message_id in letters:
                observed.dead.append((message_id, letters[message_id]))
            elif message_id in processed:
                observed.duplicates.append((message_id, canonical(processed[message_id])))
    observed.tables = snapshot(engine, tables)
    observed.results = processed
    observed.dead.sort()
    observed.duplicates.sort()
    observed.committed.sort()
    return observed


# -- the framework ------------------------------------------------------------------------------


class ProgramConsumer(Consumer):
    """Runs each message's program in ``handle`` (subclassed per run for the settings)."""

    name: ClassVar[str | None] = "differential"
    batch_size: ClassVar[int] = 16
    poll_timeout: ClassVar[float] = 0.01
    retry_policy: ClassVar[RetryPolicy] = RETRY

    def __init__(self, tables: Tables, scenario: Scenario) -> None:
        self.interpreter = Interpreter(tables, scenario)
        #: Handler calls per message id (for "raise on the first k calls" only).
        self.calls: dict[str, int] = {}
        #: Messages whose ``Raise`` made the last batch call raise (counted there).
        self.pending: dict[str, bool] = {}
        self.duplicates: list[tuple[str, str]] = []
        self.committed: list[str] = []

    def handle(self, message: Message, ctx: Context) -> Any:
        """One message's program; a ``Raise(k)`` raises in the first ``k`` calls."""
        message_id = str(message.id)
        if self.pending.pop(message_id, False):  # the fallback of a batch call that raised
            calls = self.calls[message_id]
        else:
            calls = self.calls[message_id] = self.calls.get(message_id, 0) + 1
        return self.interpreter.run(ctx.session, ctx.stage, message_id, raises_until(calls))

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        """Record the stored result a duplicate gets."""
        self.duplicates.append((str(message.id), canonical(stored_result)))

    def after_commit(self, messages: Sequence[Message]) -> None:
        """Record the committed messages."""
        self.committed.extend(str(message.id) for message in messages)


class BatchProgramConsumer(ProgramConsumer):
    """Also a ``handle_batch`` running the batch's programs in order in one call.

    A message's ``Raise(k)`` counts as a call of that message only when it makes the
    batch call raise: if the framework then falls back to ``handle`` for that message,
    that call is the same attempt (not counted again); if it takes the batch call's
    failure as the message's own (a batch of one), the next call is the next attempt.
    """

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> dict[str, Any]:
        """Every message's program, in order; results by message id."""
        results: dict[str, Any] = {}
        for message in messages:
            self.pending.pop(str(message.id), None)
        for message in messages:
            message_id = str(message.id)
            upcoming = self.calls.get(message_id, 0) + 1
            try:
                result = self.interpreter.run(
                    ctx.session, ctx.stage, message_id, raises_until(upcoming)
                )
            except PlannedFailure:
                self.calls[message_id] = upcoming
                self.pending[message_id] = True
                raise
            if result is not None:
                results[message_id] = result
        return results


def consumer_for(
    tables: Tables, scenario: Scenario, isolation: str, style: str, name: str
) -> ProgramConsumer:
    """A consumer running ``scenario``'s programs with these settings."""
    base = BatchProgramConsumer if style == "handle_batch" else ProgramConsumer
    settings = {
        "name": name,
        "failure_isolation": isolation,
        "batch_size": scenario.batch_size,
        "table_prefix": tables.prefix,
    }
    consumer_class = type(f"Program_{isolation}_{style}", (base,), settings)
    consumer: ProgramConsumer = consumer_class(tables, scenario)
    return consumer


def stored_results(engine: Engine, prefix: str, name: str) -> dict[str, Any]:
    """The dedup table's stored results of consumer ``name``, by message id."""
    processed = schema(prefix).processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(processed.c.message_id, processed.c.result).where(
                processed.c.consumer_name == name
            )
        ).all()
    return {row[0]: row[1] for row in rows}


def run_bounded(
    consumer: Consumer,
    broker: InMemoryBroker,
    queue: str,
    engine: Engine,
    timeout: float = RUN_TIMEOUT,
) -> str | None:
    """``run_until_idle`` with a deadline: None, or why the run failed (the worker
    raised, was still busy after ``timeout`` seconds, or left deliveries unsettled)."""
    stop = StopToken()
    timer = threading.Timer(timeout, stop.request)
    timer.start()
    crash: str | None = None
    try:
        Worker(consumer, broker.transport(queue), engine, stop=stop).run(until_idle=True)
    except Exception as error:
        crash = f"{type(error).__name__}: {error}"
    finally:
        timer.cancel()
    if stop.requested:
        return f"not idle after {timeout:.0f} s"
    if crash is None and broker.pending(queue):
        return f"{broker.pending(queue)} deliveries left unsettled"
    return crash


def run_framework(
    engine: Engine, tables: Tables, scenario: Scenario, isolation: str, style: str
) -> Observed:
    """The scenario through mqdedup: an in-memory broker and a worker until idle."""
    reset(engine, tables)
    name = f"diff-{uuid.uuid4().hex[:10]}"
    broker = InMemoryBroker()
    for index in scenario.deliveries:
        broker.publish(QUEUE, json.dumps({"i": index}), message_id=scenario.ids[index])
    consumer = consumer_for(tables, scenario, isolation, style, name)
    observed = Observed()
    observed.crash = run_bounded(consumer, broker, QUEUE, engine)
    observed.tables = snapshot(engine, tables)
    observed.results = stored_results(engine, tables.prefix, name)
    observed.dead = sorted(
        (str(letter.message.headers["message-id"]), letter.record.attempts)
        for letter in broker.dead_letters.get(QUEUE, [])
    )
    observed.unexplained = [
        str(letter.message.headers["message-id"])
        for letter in broker.dead_letters.get(QUEUE, [])
        if not letter.record.reason
    ]
    observed.duplicates = sorted(consumer.duplicates)
    observed.committed = sorted(consumer.committed)
    return observed


def describe(scenario: Scenario) -> str:
    """``scenario`` one message a line (for failure messages)."""
    lines = [
        f"batch_size={scenario.batch_size}, deliveries: "
        + " ".join(scenario.ids[index] for index in scenario.deliveries)
    ]
    for message_id, program in zip(scenario.ids, scenario.programs, strict=True):
        ops = "; ".join(repr(op) for op in program.ops) or "(nothing)"
        lines.append(f"  {message_id}: {ops}{'' if program.returns else ' -> None'}")
    return "\n".join(lines)


def assert_matches(engine: Engine, tables: Tables, scenario: Scenario, isolation: str) -> None:
    """Fail with the differences when mqdedup and the reference differ on ``scenario``."""
    found = check(engine, tables, scenario, isolations=[isolation])
    assert not found, failure_report(scenario, found)


def failure_report(scenario: Scenario, found: Sequence[str]) -> str:
    """The assertion message of a differential test."""
    return "\n".join(
        ["mqdedup and the reference differ", describe(scenario), "differences:", *found]
    )


def check(
    engine: Engine,
    tables: Tables,
    scenario: Scenario,
    isolations: Sequence[str] = ISOLATIONS,
    styles: Sequence[str] = STYLES,
) -> list[str]:
    """Run the reference and every (isolation, style); the differences, labelled."""
    expected = run_reference(engine, tables, scenario)
    found: list[str] = []
    for isolation in isolations:
        for style in styles:
            actual = run_framework(engine, tables, scenario, isolation, style)
            found.extend(f"[{isolation}/{style}] {line}" for line in differences(expected, actual))
    return found


def hypothesis_settings(examples: int, *, shrink: bool = False) -> settings:
    """Deterministic examples (CI), no example database, no deadline; no shrinking
    unless asked (a shrink reruns a scenario through every mode hundreds of times)."""
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# -- the generator ----------------------------------------------------------------------------

#: Operation kinds, repeated by weight.
KINDS = (
    *("insert",) * 4,
    *("update",) * 2,
    "bump",
    "delete",
    "copy",
    *("ledger",) * 3,
    "count_into",
    *("orm",) * 2,
    *("read",) * 2,
    "reuse_dict",
    "reuse_rows",
    *("raise",) * 2,
    "odd",
    *("stage",) * 3,
    "stage_counter",
)
MAX_MESSAGES = 8
MAX_OPS = 6
ID_FLAVOURS = ("m{}", "mé-{}", "消息-{}")


def row_id(message: int, slot: int, offset: int = 0) -> int:
    """The id of a row a message's operation writes (unique per message and slot)."""
    return 1000 * (message + 1) + 10 * slot + offset


def _extra(draw: st.DrawFn, columns: Sequence[str]) -> Extra:
    chosen = draw(st.lists(st.sampled_from(columns), unique=True, max_size=len(columns)))
    extra: list[tuple[str, Any]] = []
    for column in sorted(chosen):
        if column in ("val", "data"):  # data: the number its JSON value is made from
            extra.append((column, draw(st.integers(-5, 50))))
        else:
            extra.append((column, draw(st.sampled_from(NOTES))))
    return tuple(extra)


def _op(draw: st.DrawFn, message: int, slot: int, known: list[int]) -> Op:
    """One operation of message ``message`` at position ``slot``; ``known``: item ids a
    write may target (seeds and items inserted by operations drawn so far)."""
    kind = draw(st.sampled_from(KINDS))
    own = row_id(message, slot)
    target = draw(st.sampled_from(known))
    qty = draw(st.integers(0, 99))
    op: Op
    if kind == "insert":
        style = draw(st.sampled_from(("params", "params", "values", "many")))
        op = InsertItem(
            own,
            qty,
            _extra(draw, ("note", "tag", "data")),
            style,
            qty_from_read=draw(st.booleans()),
        )
        known.extend((own, own + 1) if style == "many" else (own,))
    elif kind == "update":
        sets = _extra(draw, ("note",))
        if draw(st.booleans()) or not sets:
            sets = (("qty", qty), *sets)
        op = UpdateItem(target, sets, qty_from_read=draw(st.booleans()))
    elif kind == "bump":
        op = BumpItem(target, draw(st.integers(-5, 5)))
    elif kind == "delete":
        op = DeleteItem(target)
    elif kind == "copy":
        op = CopyTotal(own)
    elif kind == "ledger":
        op = LedgerEntry(own, draw(st.integers(1, 60)), draw(st.sampled_from(("scalar", "select"))))
    elif kind == "count_into":
        op = CountLedgerInto(target)
    elif kind == "orm":
        op = OrmAdd(
            own,
            qty,
            draw(st.sampled_from(("none", "update", "delete"))),
            flush=draw(st.booleans()),
        )
        known.append(own)
    elif kind == "read":
        op = Read(draw(st.sampled_from(("sum", "item", "ledger"))), target)
    elif kind == "reuse_dict":
        qtys = tuple(draw(st.lists(st.integers(0, 99), min_size=2, max_size=3)))
        op = ReuseDict(own, qtys, shared=draw(st.booleans()))
        known.extend(own + offset for offset in range(len(qtys)))
    elif kind == "reuse_rows":
        qtys = tuple(draw(st.lists(st.integers(0, 99), min_size=1, max_size=3)))
        op = ReuseRows(own, qtys)
        known.extend(own + offset for offset in range(len(qtys)))
    elif kind == "raise":
        op = Raise(draw(st.sampled_from((None, 1, 1, 2, 3))))
    elif kind == "odd":
        op = OddWrite(own, draw(st.sampled_from(("null", "list"))))
    elif kind == "stage":
        op = StageRow(
            own,
            _extra(draw, ("val", "note", "data")),
            target=draw(st.sampled_from(("table", "table", "statement"))),
            bad=draw(st.integers(0, 5)) == 0,
            mutate=draw(st.booleans()),
        )
    else:
        op = StageCounter(draw(st.sampled_from(COUNTERS)), draw(st.integers(1, 9)))
    return op


@st.composite
def scenarios(draw: st.DrawFn, max_messages: int = MAX_MESSAGES) -> Scenario:
    """A scenario: 1 to ``max_messages`` messages, their programs, copies, a batch size."""
    count = draw(st.integers(1, max_messages))
    flavour = draw(st.sampled_from(ID_FLAVOURS))
    ids = tuple(flavour.format(index) for index in range(count))
    known: list[int] = [*SEED_ITEMS, 999]  # 999: matches nothing
    programs = []
    for message in range(count):
        ops = [_op(draw, message, slot, known) for slot in range(draw(st.integers(0, MAX_OPS)))]
        programs.append(Program(tuple(ops), returns=draw(st.integers(0, 4)) > 0))
    deliveries = list(range(count))
    for _ in range(draw(st.integers(0, 3))):  # copies, later than their first delivery
        message = draw(st.integers(0, count - 1))
        position = draw(st.integers(deliveries.index(message) + 1, len(deliveries)))
        deliveries.insert(position, message)
    batch_size = draw(st.sampled_from((16, 16, 16, 3, 2, 1)))
    return Scenario(ids, tuple(programs), tuple(deliveries), batch_size)


SCENARIOS = scenarios()
