"""Steps and hooks that cannot crash a worker or repeat an external call (issue #39).

On real PostgreSQL and MariaDB (and SQLite, the embedded default), with the in-memory
broker:

* ``on_duplicate`` raising for a copy that arrives in the same batch as its first
  copy: the worker goes on, every delivery is settled once, each effect happens once
  (sync and async consumers); a raising ``message_id_strategy`` dead-letters its
  message alone;
* a rerun of a step returns exactly the value its first run returned (key order,
  ``1e16`` a float, big ints, ``-0.0``, NUL, a lone surrogate, nesting), and the call is
  made once;
* a result that cannot be recorded (a set, NaN, nesting deeper than 100 levels)
  dead-letters its message at once, after one call, and a redelivery of the message
  does not call again;
* purging keeps a message's steps that are newer than the cutoff.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from mqdedup import (
    AsyncConsumer,
    AsyncContext,
    Consumer,
    Context,
    InMemoryBroker,
    Message,
    RetryPolicy,
    run_until_idle,
)
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.ids import from_callable
from mqdedup.dedup.steps import StepStore, loaded
from mqdedup.dedup.store import DedupStore, utcnow
from tests.integration.rabbitmq.support import order_counts
from tests.services import TestDatabase, prefixed_database, table_prefix
from tests.support import orders_table

pytestmark = pytest.mark.integration

QUEUE = "steps"
RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    """A database of each kind with this test's own tables."""
    prefix = table_prefix()
    business = orders_table(prefix).metadata
    if request.param == "sqlite":
        url, service = f"sqlite:///{tmp_path / 'steps.db'}", "SQLite"
    elif request.param == "postgresql":
        url, service = request.getfixturevalue("pg_url"), "PostgreSQL"
    else:
        url, service = request.getfixturevalue("mariadb_url"), "MariaDB"
    with prefixed_database(url, service, business, prefix=prefix) as opened:
        yield opened


@pytest.fixture(params=["postgresql", "mariadb"])
def server_database(request: pytest.FixtureRequest) -> Iterator[TestDatabase]:
    """PostgreSQL and MariaDB (a step records in a transaction of its own there)."""
    prefix = table_prefix()
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "mariadb_url")
    service = "PostgreSQL" if request.param == "postgresql" else "MariaDB"
    with prefixed_database(url, service, orders_table(prefix).metadata, prefix=prefix) as opened:
        yield opened


def step_rows(db: TestDatabase) -> dict[str, tuple[str, int, Any]]:
    table = schema(db.prefix).steps
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, table.c.state, table.c.attempts, table.c.result)
        )
        return {row.message_id: (row.state, row.attempts, loaded(row.result)) for row in rows}


# -- hooks -------------------------------------------------------------------------------


def publish_each_twice_in_a_row(broker: InMemoryBroker, count: int) -> list[str]:
    """Each message, then its copy right behind it: both in the same batch."""
    ids = [f"m-{n}" for n in range(count)]
    for message_id in ids:
        for _copy in range(2):
            broker.publish(QUEUE, json.dumps({"n": message_id}), message_id=message_id)
    return ids


def test_on_duplicate_raising_for_a_copy_in_the_same_batch_crashes_nothing(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    orders = orders_table(db.prefix)
    duplicates: Counter[str] = Counter()

    class Raising(Consumer):
        name = "raising-on-duplicate"
        table_prefix = db.prefix
        batch_size = 40
        poll_timeout = 0.02
        retry_policy = RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id, body="x"))
            return {"order": message.id}

        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            duplicates[str(message.id)] += 1
            assert stored_result == {"order": message.id}
            raise RuntimeError("the duplicate hook is broken")

    broker = InMemoryBroker()
    ids = publish_each_twice_in_a_row(broker, 10)
    metrics = run_until_idle(Raising(), broker.transport(QUEUE), db.engine)  # no crash

    assert broker.settled_count[QUEUE] == 2 * len(ids)  # each delivery settled once
    assert broker.pending(QUEUE) == 0 and broker.dead_letters.get(QUEUE, []) == []
    assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
    assert duplicates == dict.fromkeys(ids, 1)  # called once per copy, not again
    assert metrics.processed == len(ids) and metrics.duplicates == len(ids)
    assert "the messages keep their fate" in caplog.text


def test_an_async_on_duplicate_raising_for_a_copy_in_the_same_batch_crashes_nothing(
    db: TestDatabase,
) -> None:
    orders = orders_table(db.prefix)
    duplicates: Counter[str] = Counter()

    class AsyncRaising(AsyncConsumer):
        name = "async-raising-on-duplicate"
        table_prefix = db.prefix
        batch_size = 40
        poll_timeout = 0.02

        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            await ctx.session.execute(insert(orders).values(message_id=message.id, body="a"))
            return None

        async def on_duplicate(self, message: Message, stored_result: Any) -> None:
            duplicates[str(message.id)] += 1
            raise RuntimeError("the async duplicate hook is broken")

    broker = InMemoryBroker()
    ids = publish_each_twice_in_a_row(broker, 10)

    async def scenario() -> None:
        engine = create_async_engine(db.url)
        try:
            await Worker(AsyncRaising(), broker.transport(QUEUE), engine).run_async(until_idle=True)
        finally:
            await engine.dispose()

    asyncio.run(scenario())

    assert broker.settled_count[QUEUE] == 2 * len(ids)
    assert broker.pending(QUEUE) == 0 and broker.dead_letters.get(QUEUE, []) == []
    assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
    assert duplicates == dict.fromkeys(ids, 1)


def test_a_raising_message_id_strategy_dead_letters_its_message_alone(db: TestDatabase) -> None:
    orders = orders_table(db.prefix)

    def message_id(message: Message) -> str:
        body = message.json()
        if body["n"] == "m-3":
            raise KeyError("no order number in this body")
        return str(body["n"])

    class Strategic(Consumer):
        name = "raising-strategy"
        table_prefix = db.prefix
        batch_size = 40
        poll_timeout = 0.02
        message_id_strategy = from_callable(message_id)

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id, body="x"))
            return None

    broker = InMemoryBroker()
    ids = publish_each_twice_in_a_row(broker, 6)
    run_until_idle(Strategic(), broker.transport(QUEUE), db.engine)

    assert order_counts(db.engine, orders) == {i: 1 for i in ids if i != "m-3"}
    letters = broker.dead_letters[QUEUE]
    assert len(letters) == 2  # both copies of m-3, with the strategy's reason
    assert all("message id strategy failed: KeyError" in d.record.reason for d in letters)
    assert broker.settled_count[QUEUE] == 2 * len(ids)  # the dead letters too
    assert broker.pending(QUEUE) == 0


# -- exact reruns ------------------------------------------------------------------------


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


#: What a third party may answer: key order matters, 1e16 is a float, ints beyond 64
#: bits, negative zero, nesting (MariaDB's JSON allows 32 levels); and text with
#: non-ASCII characters, NUL and a lone surrogate.
ANSWERS: dict[str, dict[str, Any]] = {
    "numbers": {
        "z": 1,
        "a": [1e16, 0.1, 1.5e-300, -0.0, 10**20, True, None],
        "nested": {"b": {"y": [], "x": {}}, "a": [[[["deep"]]]]},
        "m": 12345678901234567890.0,
        "deep": nested(99),  # 100 levels with the dict: the most a result may have
    },
    "text": {"z": "caf\u00e9 \u2603", "nul": "a\x00b", "lone": "\ud800", "a": ["\udfff\x00"]},
}


def exactly(value: Any) -> str:
    """``value`` with its key order and number types visible (repr keeps both)."""
    return repr(value)


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_a_rerun_returns_exactly_the_value_the_first_run_returned(
    database: TestDatabase, answer: str
) -> None:
    calls: Counter[str] = Counter()
    seen: dict[str, list[str]] = {}
    orders = orders_table(database.prefix)

    class Quoting(Consumer):
        name = "quoting"
        table_prefix = database.prefix
        batch_size = 10
        poll_timeout = 0.02
        retry_policy = RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            def quote(_key: str) -> dict[str, Any]:
                calls[str(message.id)] += 1
                return ANSWERS[answer]

            value = ctx.step("quote", quote)
            runs = seen.setdefault(str(message.id), [])
            runs.append(exactly(value))
            ctx.session.execute(insert(orders).values(message_id=message.id, body="q"))
            if len(runs) == 1:
                raise RuntimeError("fails once after its step: the retry reads the record")
            return None

    broker = InMemoryBroker()
    ids = [f"q-{n}" for n in range(4)]
    for message_id in ids:
        broker.publish(QUEUE, b"{}", message_id=message_id)
    run_until_idle(Quoting(), broker.transport(QUEUE), database.engine)

    expected = exactly(ANSWERS[answer])
    assert seen == {i: [expected, expected] for i in ids}  # first run == rerun, exactly
    assert order_counts(database.engine, orders) == dict.fromkeys(ids, 1)
    assert broker.dead_letters.get(QUEUE, []) == []
    if database.engine.dialect.name != "sqlite":  # SQLite: the record is the message's
        assert calls == dict.fromkeys(ids, 1)
        assert {i: exactly(row[2]) for i, row in step_rows(database).items()} == dict.fromkeys(
            ids, expected
        )


# -- results that cannot be recorded -----------------------------------------------------


UNSTORABLE = {
    "u-set": ({1, 2}, "TypeError: Object of type set is not JSON serializable"),
    "u-nan": ({"price": math.nan}, "Out of range float values are not JSON compliant"),
    "u-deep": (nested(101), "nested deeper than 100 levels"),
    "u-object": ({"at": object()}, "Object of type object is not JSON serializable"),
    "u-keys": ({(1, 2): "tuple key"}, "keys must be str, int, float, bool or None"),
}


def test_a_result_that_cannot_be_recorded_is_called_once_and_never_again(
    server_database: TestDatabase,
) -> None:
    db = server_database
    calls: Counter[str] = Counter()

    class Unstorable(Consumer):
        name = "unstorable"
        table_prefix = db.prefix
        batch_size = 10
        poll_timeout = 0.02
        retry_policy = RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            def call(_key: str) -> Any:
                calls[str(message.id)] += 1
                return UNSTORABLE[str(message.id)][0]

            ctx.step("call", call)
            return None

    broker = InMemoryBroker()
    for message_id in UNSTORABLE:
        broker.publish(QUEUE, b"{}", message_id=message_id)
    run_until_idle(Unstorable(), broker.transport(QUEUE), db.engine)
    broker.publish(QUEUE, b"{}", message_id="u-nan")  # again, after its dead letter
    run_until_idle(Unstorable(), broker.transport(QUEUE), db.engine)

    assert calls == dict.fromkeys(UNSTORABLE, 1)  # once: not retried, not redelivered
    letters = broker.dead_letters[QUEUE]
    reasons = {d.message.headers["message-id"]: d.record.reason for d in letters}
    assert len(letters) == len(UNSTORABLE) + 1
    for message_id, (_value, problem) in UNSTORABLE.items():
        assert "cannot be recorded as JSON" in reasons[message_id], reasons[message_id]
        assert problem in reasons[message_id]
        assert all(d.record.attempts == 1 for d in letters)
    redelivered = letters[-1].record.reason
    assert "was called on an earlier run" in redelivered and "not called again" in redelivered
    rows = step_rows(db)
    assert {i: (state, attempts) for i, (state, attempts, _) in rows.items()} == dict.fromkeys(
        UNSTORABLE, ("unstorable", 1)
    )


# -- purge -------------------------------------------------------------------------------


def test_a_purge_keeps_the_newer_steps_of_a_message(database: TestDatabase) -> None:
    store = StepStore(database.prefix)
    table = schema(database.prefix).steps
    with database.engine.begin() as connection:
        for message_id in ("old-and-new", "new"):
            for name in ("old", "new"):
                store.start(connection, "purging", message_id, name)
                store.record(connection, "purging", message_id, name, '{"ok":1}')
        connection.execute(
            update(table)
            .where(table.c.message_id == "old-and-new", table.c.name == "old")
            .values(started_at=utcnow() - timedelta(days=30))
        )

    DedupStore(database.prefix).purge(database.engine, timedelta(days=7), chunk_size=1)

    with database.engine.connect() as connection:
        left = connection.execute(select(table.c.message_id, table.c.name)).all()
    assert sorted((row.message_id, row.name) for row in left) == [
        ("new", "new"),
        ("new", "old"),
        ("old-and-new", "new"),
    ]


def test_an_async_step_with_an_unstorable_result_is_called_once(db: TestDatabase) -> None:
    calls: Counter[str] = Counter()

    class AsyncUnstorable(AsyncConsumer):
        name = "async-unstorable"
        table_prefix = db.prefix
        poll_timeout = 0.02
        retry_policy = RETRY

        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            async def call(_key: str) -> Any:
                calls[str(message.id)] += 1
                return {"at": {1, 2}} if message.id == "bad" else {"z": 1, "a": 1e16}

            value = await ctx.step("call", call)
            assert exactly(value) == exactly({"z": 1, "a": 1e16})
            return None

    broker = InMemoryBroker()
    for message_id in ("good", "bad"):
        broker.publish(QUEUE, b"{}", message_id=message_id)

    async def scenario() -> None:
        engine = create_async_engine(db.url)
        try:
            await Worker(AsyncUnstorable(), broker.transport(QUEUE), engine).run_async(
                until_idle=True
            )
        finally:
            await engine.dispose()

    asyncio.run(scenario())

    assert calls == {"good": 1, "bad": 1}
    [letter] = broker.dead_letters[QUEUE]
    assert "cannot be recorded as JSON" in letter.record.reason
    assert {i: row[:2] for i, row in step_rows(db).items()} == {
        "good": ("done", 1),
        "bad": ("unstorable", 1),
    }
