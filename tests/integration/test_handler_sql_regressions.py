"""One regression test per failure class of issue 28 ("Why"), on the real PostgreSQL.

Each is ordinary handler code a user writes; each failed before the rewrite (implicit
write deferral, ``defer_writes = True``, and the hand-made transaction-mode path):

1. rows of one ``insert(t)`` with different key sets across a batch keep every column;
2. an UPDATE with ``bindparam`` whose parameter sets differ updates what each says;
3. ``session.add(obj)`` then a Core update / delete of that row applies to it;
4. a running balance through a scalar subquery (or ``from_select``) over another table
   the batch writes: 10, 30, 60;
5. a parameter dict, its nested JSON value and an executemany list, reused and mutated
   after the write, give each row its own values (``ctx.stage`` too);
6. a Python list for a Text column: exactly what immediate execution does (psycopg
   stores the array's text, other drivers refuse it), never extra rows, batch-mates
   commit; ``ctx.stage`` does the same or refuses at the call, naming the column;
7. transaction mode: a handler that reads then raises is retried and dead-lettered and
   the worker goes on with later messages;
8. an ``after_commit`` hook reads a result kept from the handler (``rowcount``);
9. the only message of a batch whose write fails at commit is retried then
   dead-lettered (its handler ran ``max_attempts`` times), while a valid single message
   whose writes a set-based path could not write is never dead-lettered;
10. a handler changing ``client_encoding`` fails alone (``HandlerChangedConnectionError``:
    its rollback undoes the ``SET``, it is retried, then dead-lettered); the next claims
    are under the right (non-ASCII) ids, copies are duplicates, not doubled effects;
    duplicates still get their stored results, and an id LATIN1 could not hold does not
    stop the worker.

Every run is bounded (``differential.run_bounded``): a worker that raises, never becomes
idle or leaves a delivery unsettled fails the test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import pytest
from sqlalchemy import (
    Column,
    Engine,
    ForeignKeyConstraint,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.orm import Session

from mqdedup import Consumer, Context, InMemoryBroker, Message
from tests import differential
from tests.differential import RETRY, Tables
from tests.services import checked_engine, table_prefix

pytestmark = pytest.mark.integration
QUEUE = "regressions"


@cache
def extra_tables(prefix: str) -> tuple[MetaData, Table, Table, Table]:
    """``parent`` and ``child`` with a foreign key checked at COMMIT (deferred), and
    ``notes`` (a generated key, nullable columns: extra rows would fit)."""
    metadata = MetaData()
    parent = Table(
        f"{prefix}parent", metadata, Column("id", Integer, primary_key=True, autoincrement=False)
    )
    child = Table(
        f"{prefix}child",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("parent_id", Integer, nullable=False),
        ForeignKeyConstraint(["parent_id"], [parent.c.id], deferrable=True, initially="DEFERRED"),
    )
    notes = Table(
        f"{prefix}notes",
        metadata,
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("msg", String(64), nullable=True),
        Column("note", Text, nullable=True),
    )
    return metadata, parent, child, notes


@dataclass(frozen=True)
class Env:
    """This test's engine, tables (seeded items 1, 2, 3) and prefix."""

    engine: Engine
    tables: Tables
    prefix: str


@pytest.fixture
def env(pg_url: str) -> Iterator[Env]:
    engine = checked_engine(pg_url, "PostgreSQL")
    prefix = table_prefix()
    tables = differential.create_tables(engine, prefix)
    extra_tables(prefix)[0].create_all(engine)
    differential.reset(engine, tables)
    try:
        yield Env(engine, tables, prefix)
    finally:
        extra_tables(prefix)[0].drop_all(engine)
        differential.drop_tables(engine, prefix)
        engine.dispose()


class Handler(Consumer):
    """The base of this module's consumers: this test's tables, a fast retry policy,
    and what a test wants to see (calls per message, duplicates)."""

    name: ClassVar[str | None] = "regressions"
    poll_timeout = 0.01
    retry_policy = RETRY

    def __init__(self, env: Env) -> None:
        self.t = env.tables
        self.calls: dict[str, int] = {}
        self.duplicates: list[str] = []

    def count(self, message: Message) -> str:
        """The message id, with the call counted."""
        message_id = str(message.id)
        self.calls[message_id] = self.calls.get(message_id, 0) + 1
        return message_id

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        self.duplicates.append(str(message.id))


def consumer(cls: type[Handler], env: Env, **settings: Any) -> Handler:
    """An instance of ``cls`` on ``env``'s tables with ``settings`` (class attributes)."""
    configured = type(cls.__name__, (cls,), {"table_prefix": env.prefix, **settings})
    instance: Handler = configured(env)
    return instance


def run(env: Env, handler: Consumer, messages: Sequence[tuple[str, Any]]) -> InMemoryBroker:
    """Publish ``(message id, JSON body)`` pairs, run ``handler`` until idle (bounded);
    the worker must neither raise nor leave a delivery unsettled."""
    broker = InMemoryBroker()
    for message_id, body in messages:
        broker.publish(QUEUE, json.dumps(body), message_id=message_id)
    crash = differential.run_bounded(handler, broker, QUEUE, env.engine, timeout=60)
    assert crash is None, f"the worker failed: {crash}"
    return broker


def dead(broker: InMemoryBroker) -> list[tuple[str, int]]:
    """``(message id, attempts)`` of each dead letter, sorted."""
    return sorted(
        (str(letter.message.headers["message-id"]), letter.record.attempts)
        for letter in broker.dead_letters.get(QUEUE, [])
    )


def reasons(broker: InMemoryBroker) -> dict[str, str]:
    """The reason of each dead letter, by message id."""
    return {
        str(letter.message.headers["message-id"]): letter.record.reason
        for letter in broker.dead_letters.get(QUEUE, [])
    }


def items(env: Env, *, seeds: bool = False, data: bool = False) -> list[tuple[Any, ...]]:
    """The rows of ``items`` (without the seed rows 1, 2, 3 unless asked; without the
    ``data`` column unless asked)."""
    rows = differential.snapshot(env.engine, env.tables)["items"]
    return [
        row if data else row[:4] for row in rows if seeds or row[0] not in differential.SEED_ITEMS
    ]


def results(env: Env, name: str = "regressions") -> dict[str, Any]:
    """Stored results of consumer ``name`` by message id."""
    return differential.stored_results(env.engine, env.prefix, name)


# -- 1. rows of one insert(t) with different key sets -------------------------------------


@pytest.mark.parametrize("via", ["execute", "stage"])
def test_rows_of_one_insert_with_different_key_sets_keep_every_column(env: Env, via: str) -> None:
    class Inserts(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            row = message.json()
            if via == "stage":
                ctx.stage(self.t.items, row)
            else:
                ctx.session.execute(self.t.insert_item, row)

    broker = run(
        env,
        consumer(Inserts, env),
        [
            ("m1", {"id": 11, "qty": 1}),
            ("m2", {"id": 12, "qty": 2, "note": "keep-me"}),
            ("m3", {"id": 13, "qty": 3, "tag": "t3"}),
            ("m4", {"id": 14, "qty": 4}),
        ],
    )

    assert items(env) == [
        (11, 1, None, None),
        (12, 2, "keep-me", None),
        (13, 3, None, "t3"),
        (14, 4, None, None),
    ]
    assert dead(broker) == []


# -- 2. UPDATE with bindparam whose parameter sets differ -----------------------------------


@pytest.mark.parametrize("via", ["execute", "stage"])
def test_an_update_with_bindparam_whose_parameter_sets_differ(env: Env, via: str) -> None:
    class Updates(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            params = message.json()  # SET what the keys besides b_id name
            if via == "stage":
                ctx.stage(self.t.update_item, params)
            else:
                ctx.session.execute(self.t.update_item, params)

    broker = run(
        env,
        consumer(Updates, env),
        [
            ("m1", {"b_id": 1, "qty": 11}),
            ("m2", {"b_id": 2, "qty": 22, "note": "keep-me"}),
            ("m3", {"b_id": 3, "qty": 33}),
        ],
    )

    assert items(env, seeds=True) == [
        (1, 11, "seed-1", None),
        (2, 22, "keep-me", None),
        (3, 33, "seed-3", None),
    ]
    assert dead(broker) == []


# -- 3. session.add(obj) then a Core update / delete of that row ----------------------------


@pytest.mark.parametrize("then", ["update", "delete"])
def test_orm_add_then_a_core_write_of_that_row_applies_to_it(env: Env, then: str) -> None:
    class AddThenWrite(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            key = message.json()["id"]
            ctx.session.add(self.t.item_class(id=key, qty=1, note="added"))
            if then == "update":
                result = ctx.session.execute(self.t.update_item, {"b_id": key, "qty": 99})
            else:
                result = ctx.session.execute(self.t.delete_item, {"b_id": key})
            return {"rowcount": differential.rowcount(result)}

    broker = run(env, consumer(AddThenWrite, env), [("m1", {"id": 21}), ("m2", {"id": 22})])

    if then == "update":
        assert items(env) == [(21, 99, "added", None), (22, 99, "added", None)]
    else:
        assert items(env) == []
    assert results(env) == {"m1": {"rowcount": 1}, "m2": {"rowcount": 1}}
    assert dead(broker) == []


# -- 4. a running balance across the messages of one batch ---------------------------------


@pytest.mark.parametrize("form", ["scalar_subquery", "from_select"])
def test_a_running_balance_across_one_batch(env: Env, form: str) -> None:
    class Payments(Handler):
        """Each payment is an item; its ledger row holds the total paid so far."""

        def handle(self, message: Message, ctx: Context) -> Any:
            items, ledger = self.t.items, self.t.ledger
            key, amount = message.json()
            ctx.session.execute(self.t.insert_item, {"id": key, "qty": amount})
            paid = func.coalesce(func.sum(items.c.qty), 0)
            total = select(paid).where(items.c.id >= 100)
            if form == "scalar_subquery":
                statement = insert(ledger).values(
                    id=key, msg=str(message.id), amount=amount, balance=total.scalar_subquery()
                )
            else:
                statement = insert(ledger).from_select(
                    ["id", "msg", "amount", "balance"],
                    select(literal(key), literal(str(message.id)), literal(amount), paid).where(
                        items.c.id >= 100
                    ),
                )
            ctx.session.execute(statement)

    broker = run(
        env, consumer(Payments, env), [("m1", [101, 10]), ("m2", [102, 20]), ("m3", [103, 30])]
    )

    assert differential.snapshot(env.engine, env.tables)["ledger"] == [
        (101, "m1", 10, 10),
        (102, "m2", 20, 30),
        (103, "m3", 30, 60),
    ]
    assert dead(broker) == []


# -- 5. a parameter dict (and list) reused and mutated ------------------------------------


@pytest.mark.parametrize("via", ["execute", "stage"])
def test_a_reused_and_mutated_parameter_dict_gives_each_row_its_own_values(
    env: Env, via: str
) -> None:
    class Reuses(Handler):
        """One row dict and one JSON value for every message, as caches go."""

        def __init__(self, env: Env) -> None:
            super().__init__(env)
            self.row: dict[str, Any] = {}
            self.data: dict[str, Any] = {"n": 0, "tags": []}

        def write(self, ctx: Context, row: Any) -> None:
            if via == "stage":
                ctx.stage(self.t.items, row)
            else:
                ctx.session.execute(self.t.insert_item, row)

        def handle(self, message: Message, ctx: Context) -> Any:
            base, qty = message.json()
            for offset in range(2):
                self.row["id"] = base + offset
                self.row["qty"] = qty + offset
                self.data["n"] = qty + offset
                self.data["tags"].clear()
                self.data["tags"].append(qty + offset)
                self.row["data"] = self.data
                self.write(ctx, self.row)
            rows = [{"id": base + 2, "qty": qty + 2, "data": {"n": qty + 2, "tags": []}}]
            if via == "stage":
                self.write(ctx, rows[0])
            else:
                ctx.session.execute(self.t.insert_item, rows)
            rows[0]["qty"] = -1  # after the write: must change nothing
            rows[0]["data"]["tags"].append("mutated")
            self.row["qty"] = -999
            self.data["n"] = -999

    broker = run(
        env,
        consumer(Reuses, env),
        [("m1", [30, 1]), ("m2", [40, 5]), ("m3", [50, 9])],
    )

    expected = []
    for base, qty in ((30, 1), (40, 5), (50, 9)):
        expected += [
            (base, qty, None, None, {"n": qty, "tags": [qty]}),
            (base + 1, qty + 1, None, None, {"n": qty + 1, "tags": [qty + 1]}),
            (base + 2, qty + 2, None, None, {"n": qty + 2, "tags": []}),
        ]
    assert items(env, data=True) == expected
    assert dead(broker) == []


# -- 6. a Python list for a Text column ----------------------------------------------------


def by_hand(env: Env, row: dict[str, Any]) -> tuple[str, Any]:
    """What immediate execution does with ``row`` in ``notes`` (rolled back):
    ``("stored", [notes written])`` or ``("refused", error)``."""
    notes = extra_tables(env.prefix)[3]
    with Session(env.engine) as session, session.begin():
        try:
            with session.begin_nested():
                session.execute(insert(notes), row)
        except Exception as error:
            return "refused", f"{type(error).__name__}: {error}"
        stored = session.execute(select(notes.c.note).where(notes.c.msg == row["msg"]))
        written = list(stored.scalars())
        session.rollback()
    return "stored", written


@pytest.mark.parametrize("via", ["execute", "stage"])
def test_a_list_for_a_text_column_does_what_immediate_execution_does(env: Env, via: str) -> None:
    notes = extra_tables(env.prefix)[3]

    class Notes(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            self.count(message)
            row = {"msg": str(message.id), "note": message.json()}
            if via == "stage":
                ctx.stage(notes, row)
            else:
                ctx.session.execute(insert(notes), row)

    kind, written = by_hand(env, {"msg": "by-hand", "note": ["a", "b"]})
    handler = consumer(Notes, env, batch_size=3)
    # m1 .. m3 in one batch, each a list; m4 (plain text) in the next
    broker = run(
        env,
        handler,
        [("m1", ["a", "b"]), ("m2", ["c", "d"]), ("m3", ["e", "f"]), ("m4", "plain")],
    )

    with env.engine.connect() as connection:
        rows = connection.execute(select(notes.c.msg, notes.c.note).order_by(notes.c.msg)).all()
    stored = [tuple(row) for row in rows]
    assert ("m4", "plain") in stored and len(stored) == len(set(stored))  # no extra rows
    lists = ("m1", "m2", "m3")
    if kind == "stored" and not dead(broker):  # psycopg: the array's text, one row each
        assert written == ["{a,b}"]
        assert stored == [("m1", "{a,b}"), ("m2", "{c,d}"), ("m3", "{e,f}"), ("m4", "plain")]
    elif kind == "stored":  # only ctx.stage may refuse it: at the call, naming the column
        assert via == "stage", reasons(broker)
        assert [key for key, _ in dead(broker)] == list(lists)
        assert all("note" in reason for reason in reasons(broker).values()), reasons(broker)
        assert stored == [("m4", "plain")]
    else:  # the driver refuses it: each such message fails alone, batch-mates commit
        assert [key for key, _ in dead(broker)] == list(lists), written
        assert stored == [("m4", "plain")]
        if via == "execute":
            assert dead(broker) == [(key, RETRY.max_attempts) for key in lists]


# -- 7. transaction mode: a handler that reads then raises -------------------------------


def test_transaction_mode_a_handler_that_reads_then_raises_is_dead_lettered_and_the_worker_goes_on(
    env: Env,
) -> None:
    class ReadsThenRaises(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            message_id = self.count(message)
            seen = ctx.session.execute(select(func.count()).select_from(self.t.items)).scalar()
            if message_id == "m1":
                raise RuntimeError(f"cannot handle {message_id} (saw {seen} items)")
            key = message.json()["id"]
            ctx.session.execute(self.t.insert_item, {"id": key, "qty": 1})
            return {"seen": seen}

    handler = consumer(ReadsThenRaises, env, failure_isolation="transaction", batch_size=2)
    broker = run(
        env,
        handler,
        [("m1", {"id": 71}), ("m2", {"id": 72}), ("m3", {"id": 73}), ("m4", {"id": 74})],
    )

    assert dead(broker) == [("m1", RETRY.max_attempts)]
    assert handler.calls["m1"] == RETRY.max_attempts
    assert [row[0] for row in items(env)] == [72, 73, 74]  # later messages processed
    assert results(env) == {"m2": {"seen": 3}, "m3": {"seen": 4}, "m4": {"seen": 5}}


# -- 8. an after_commit hook reading a kept result -------------------------------------------


@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_after_commit_reads_the_real_rowcount_of_a_result_kept_from_the_handler(
    env: Env, isolation: str
) -> None:
    class Keeps(Handler):
        def __init__(self, env: Env) -> None:
            super().__init__(env)
            self.kept: dict[str, Any] = {}
            self.seen: dict[str, int] = {}

        def handle(self, message: Message, ctx: Context) -> Any:
            params = {"b_id": message.json()["target"], "qty": 5}
            self.kept[str(message.id)] = ctx.session.execute(self.t.update_item, params)

        def after_commit(self, messages: Sequence[Message]) -> None:
            for message in messages:
                self.seen[str(message.id)] = differential.rowcount(self.kept[str(message.id)])

    handler = consumer(Keeps, env, failure_isolation=isolation)
    broker = run(
        env,
        handler,
        [("m1", {"target": 1}), ("m2", {"target": 999}), ("m3", {"target": 2})],
    )

    assert isinstance(handler, Keeps)
    assert handler.seen == {"m1": 1, "m2": 0, "m3": 1}
    assert dead(broker) == []


# -- 9. a write failing at commit, and a valid single message ------------------------------


def test_the_only_message_of_a_batch_failing_at_commit_is_dead_lettered_and_a_valid_one_never(
    env: Env,
) -> None:
    _metadata, parent, child, _notes = extra_tables(env.prefix)

    class Writes(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            message_id = self.count(message)
            if message_id == "orphan":  # the deferred foreign key fails at COMMIT
                ctx.session.execute(insert(child), {"id": 1, "parent_id": 404})
            elif message_id == "parent":
                ctx.session.add(self.t.item_class(id=90, qty=0))  # flushed before the next
                ctx.session.execute(insert(parent), {"id": 7})
                ctx.session.execute(insert(child), {"id": 2, "parent_id": 7})
            else:  # the same statement with an int and a numeric str: both valid at once
                ctx.session.execute(self.t.insert_item, {"id": 91, "qty": 5})
                ctx.session.execute(self.t.insert_item, {"id": 92, "qty": "7"})
            return {"ok": message_id}

    handler = consumer(Writes, env, batch_size=1)
    broker = run(env, handler, [("orphan", {}), ("mixed", {}), ("parent", {})])

    assert dead(broker) == [("orphan", RETRY.max_attempts)]
    assert handler.calls["orphan"] == RETRY.max_attempts  # never more runs than attempts
    assert handler.calls["mixed"] == 1 and handler.calls["parent"] == 1
    assert items(env) == [(90, 0, None, None), (91, 5, None, None), (92, 7, None, None)]
    with env.engine.connect() as connection:
        assert connection.execute(select(child.c.id, child.c.parent_id)).all() == [(2, 7)]
    assert results(env) == {"mixed": {"ok": "mixed"}, "parent": {"ok": "parent"}}


# -- 10. a handler changing client_encoding ----------------------------------------------------


@pytest.mark.parametrize("variant", ["ids", "stored_results", "any_unicode"])
@pytest.mark.parametrize("isolation", ["transaction", "auto"])
def test_claims_after_a_handler_changed_client_encoding_are_under_the_right_ids(
    env: Env, isolation: str, variant: str
) -> None:
    """The ``SET client_encoding`` is refused as that message's failure (rolled back with
    it, retried, dead-lettered); ``ids``: the non-ASCII ids after it are claimed under the
    right id, copies are duplicates (no doubled effects); ``stored_results``: the same
    with ``on_duplicate`` reading the stored results; ``any_unicode``: an id LATIN1
    cannot encode: the worker goes on."""

    class Encodings(Handler):
        def handle(self, message: Message, ctx: Context) -> Any:
            message_id = self.count(message)
            if message_id == "latin1":
                ctx.session.execute(text("SET client_encoding TO 'LATIN1'"))
            key = message.json()["id"]
            ctx.session.execute(self.t.insert_item, {"id": key, "qty": 1, "note": message_id})
            return {"id": message_id}

    settings: dict[str, Any] = {"failure_isolation": isolation, "batch_size": 2}
    if variant != "stored_results":
        settings["on_duplicate"] = Consumer.on_duplicate  # no stored results read
    handler = consumer(Encodings, env, **settings)
    # Batches: [latin1, mé-1] [ñ-2, mé-1 again] [ñ-2 again, ü-3] (+ [消息-4])
    messages = [
        ("latin1", {"id": 100}),
        ("mé-1", {"id": 101}),
        ("ñ-2", {"id": 102}),
        ("mé-1", {"id": 101}),
        ("ñ-2", {"id": 102}),
        ("ü-3", {"id": 103}),
    ]
    expected = ["mé-1", "ñ-2", "ü-3"]
    if variant == "any_unicode":
        messages.append(("消息-4", {"id": 104}))
        expected.append("消息-4")
    broker = run(env, handler, messages)
    env.engine.dispose()  # read back on fresh (UTF-8) connections

    assert dead(broker) == [("latin1", 3)], reasons(broker)
    assert "HandlerChangedConnectionError" in reasons(broker)["latin1"]
    assert results(env) == {key: {"id": key} for key in expected}
    assert items(env) == [(101 + index, 1, key, None) for index, key in enumerate(expected)]
    assert handler.calls == {"latin1": 3, **dict.fromkeys(expected, 1)}
    if variant == "stored_results":
        assert sorted(handler.duplicates) == ["mé-1", "ñ-2"]
