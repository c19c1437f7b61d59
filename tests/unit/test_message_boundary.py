"""The per-message error boundary on SQLite and the in-memory broker.

What a message carries (its id) and what its handler does (return a value no database
stores, end the transaction, write through its own connection) decide that message's
fate alone: it is dead-lettered with a reason that names the problem, its batch-mates
commit, and ``run_until_idle`` never raises. The same cases on PostgreSQL and MariaDB
are in ``tests/integration/tools/test_message_boundary.py``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.exc import OperationalError

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, ids, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.db import create_engine
from mqdedup.db.schema import schema
from mqdedup.errors import ConfigurationError
from tests.support import OrderConsumer, order_counts, orders

FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)


def claims(engine: Engine, consumer: str = "orders") -> set[str]:
    table = schema().processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id).where(table.c.consumer_name == consumer)
        )
        return {row[0] for row in rows}


def publish(broker: InMemoryBroker, message_ids: list[str | None]) -> None:
    for number, message_id in enumerate(message_ids):
        headers = {} if message_id is None else {"message-id": message_id}
        broker.publish("orders", json.dumps({"order": number}), headers=headers)


class Orders(OrderConsumer):
    retry_policy = FAST_RETRY


@pytest.mark.parametrize(
    ("bad_id", "reason"),
    [
        ("bad\x00id", "message id contains a NUL byte ('message-id' header)"),
        ("a\ud800b", "message id is not valid Unicode: a lone surrogate at position 1"),
        ("", "missing message id: empty 'message-id' header"),
        ("x" * 256, "message id is longer than 255 characters (256, 'message-id' header)"),
    ],
)
def test_an_invalid_id_is_dead_lettered_with_what_is_wrong(
    sqlite_engine: Engine, bad_id: str, reason: str
) -> None:
    broker = InMemoryBroker()
    publish(broker, ["good-1", bad_id, "good-2"])
    metrics = run_until_idle(Orders(), broker.transport("orders"), sqlite_engine)

    assert order_counts(sqlite_engine) == {"good-1": 1, "good-2": 1}
    dead = broker.dead_letters["orders"]
    assert [d.record.reason for d in dead] == [reason] or reason in dead[0].record.reason
    assert dead[0].record.attempts == 1
    assert (metrics.processed, metrics.dead_lettered) == (2, 1)
    assert broker.pending("orders") == 0


def test_the_same_id_rules_on_every_strategy() -> None:
    too_long_topic = "t" * 249
    message = Message(body=b"", source=too_long_topic, partition=3, offset=1000)
    first = ids.from_coordinates(message)
    assert len(first) <= ids.MAX_ID_LENGTH and first.endswith("/3/1000")
    assert first == ids.from_coordinates(message), "deterministic"
    other = Message(body=b"", source="u" * 249, partition=3, offset=1000)
    assert ids.from_coordinates(other) != first
    assert ids.from_coordinates(Message(body=b"", source="t", partition=0, offset=9)) == "t/0/9"

    with pytest.raises(ids.InvalidMessageIdError, match="is a int, not a string"):
        ids.from_callable(lambda m: 7)(Message(body=b""))  # type: ignore[arg-type, return-value]
    with pytest.raises(ids.InvalidMessageIdError, match="NUL"):
        ids.from_amqp_message_id(Message(body=b"", properties={"message_id": "a\x00"}))


def test_a_failing_or_bad_id_function_fails_only_its_message(sqlite_engine: Engine) -> None:
    def order_id(message: Message) -> str:
        value = message.json()["ref"]  # KeyError when the body has no ref
        return str(value) if value != "int" else 5  # type: ignore[return-value]

    class ByRef(Orders):
        message_id_strategy = ids.from_callable(order_id)

    broker = InMemoryBroker()
    for body in ({"ref": "r1"}, {"no": "ref"}, {"ref": "nul\x00"}, {"ref": "int"}, {"ref": "r2"}):
        broker.publish("orders", json.dumps(body))
    run_until_idle(ByRef(), broker.transport("orders"), sqlite_engine)

    assert order_counts(sqlite_engine) == {"r1": 1, "r2": 1}
    reasons = [d.record.reason for d in broker.dead_letters["orders"]]
    assert reasons[0].startswith("the message id strategy failed: KeyError")
    assert reasons[1] == "message id contains a NUL byte (id from order_id)"
    assert reasons[2] == "message id is a int, not a string (id from order_id)"


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (math.nan, "not strict JSON"),
        (math.inf, "not strict JSON"),
        ({"text": "a\x00b"}, "contains a NUL character"),
        ({"a\x00": 1}, "contains a NUL character"),
        (["\udc80"], "lone surrogate"),
        ({1, 2}, "not JSON-serialisable"),
    ],
)
@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_a_result_no_database_stores_fails_only_its_message(
    sqlite_engine: Engine, result: Any, reason: str, isolation: str
) -> None:
    class BadResult(Orders):
        failure_isolation = isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            stored = super().handle(message, ctx)
            return result if message.id == "bad" else stored

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad", "good-2"])
    run_until_idle(BadResult(), broker.transport("orders"), sqlite_engine)

    assert order_counts(sqlite_engine) == {"good-1": 1, "good-2": 1}
    assert claims(sqlite_engine) == {"good-1", "good-2"}
    (dead,) = broker.dead_letters["orders"]
    assert reason in dead.record.reason and dead.record.attempts == 1


def test_bulk_results_for_other_ids_are_not_stored(sqlite_engine: Engine) -> None:
    class Bulk(Orders):
        def handle_batch(self, messages: Any, ctx: Any) -> dict[str, Any]:
            ctx.session.execute(insert(orders), [{"message_id": m.id} for m in messages])
            return {"bad\x00key": 1, "old": {"stolen": True}, **{m.id: "ok" for m in messages}}

    table = schema().processed
    with sqlite_engine.begin() as connection:
        connection.execute(
            insert(table).values(
                consumer_name="orders", message_id="old", processed_at=func.now(), result="mine"
            )
        )
    broker = InMemoryBroker()
    publish(broker, ["m1", "m2"])
    run_until_idle(Bulk(), broker.transport("orders"), sqlite_engine)
    with sqlite_engine.connect() as connection:
        stored = dict(connection.execute(select(table.c.message_id, table.c.result)).all())
    assert stored == {"old": "mine", "m1": "ok", "m2": "ok"}


@pytest.mark.parametrize(
    "name", ["n" * 256, "a\x00b", "   ", "x\udc80"], ids=["long", "nul", "blank", "surrogate"]
)
def test_a_consumer_name_the_tables_cannot_hold_is_refused_at_start(
    sqlite_engine: Engine, name: str
) -> None:
    class Named(Orders):
        pass

    Named.name = name
    broker = InMemoryBroker()
    publish(broker, ["m1"])
    with pytest.raises(ConfigurationError, match="consumer name"):
        run_until_idle(Named(), broker.transport("orders"), sqlite_engine)
    table = schema().processed
    with sqlite_engine.connect() as connection:
        claimed = connection.execute(select(func.count()).select_from(table)).scalar_one()
    assert broker.pending("orders") == 1 and claimed == 0


@pytest.mark.parametrize("method", ["commit", "rollback", "close", "begin"])
@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_a_handler_cannot_end_the_transaction(
    sqlite_engine: Engine, method: str, isolation: str
) -> None:
    class EndsIt(Orders):
        failure_isolation = isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            result = super().handle(message, ctx)
            if message.id == "bad":
                getattr(ctx.session, method)()
            return result

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad", "good-2"])
    metrics = run_until_idle(EndsIt(), broker.transport("orders"), sqlite_engine)

    assert order_counts(sqlite_engine) == {"good-1": 1, "good-2": 1}
    assert claims(sqlite_engine) == {"good-1", "good-2"}
    (dead,) = broker.dead_letters["orders"]
    assert "a handler must not end the transaction" in dead.record.reason
    assert f"ctx.session.{method}()" in dead.record.reason
    assert (metrics.processed, metrics.duplicates, metrics.dead_lettered) == (2, 0, 1)


def test_savepoints_and_the_outbox_still_work_in_a_handler(sqlite_engine: Engine) -> None:
    class Nested(Orders):
        def handle(self, message: Message, ctx: Context) -> Any:
            with ctx.session.begin_nested():
                ctx.session.execute(insert(orders).values(message_id=message.id))
            ctx.outbox.publish({"seen": message.id}, topic="events")
            return None

    broker = InMemoryBroker()
    publish(broker, ["m1", "m2"])
    run_until_idle(Nested(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m1": 1, "m2": 1}
    outbox = schema().outbox
    with sqlite_engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(outbox)).scalar_one() == 2


@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_a_handler_writing_through_its_own_sqlite_connection_fails_fast(
    tmp_path: Path, sqlite_engine: Engine, isolation: str
) -> None:
    url = str(sqlite_engine.url)
    own = create_engine(url)  # the handler's own engine on the same file (busy timeout 30 s)

    class OwnConnection(Orders):
        failure_isolation = isolation  # type: ignore[assignment]
        retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.001)

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "bad":
                with own.begin() as connection:
                    connection.execute(insert(orders).values(message_id="own"))
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad", "good-2"])
    started = time.monotonic()
    run_until_idle(OwnConnection(), broker.transport("orders"), sqlite_engine)
    elapsed = time.monotonic() - started
    own.dispose()

    assert order_counts(sqlite_engine) == {"good-1": 1, "good-2": 1}
    (dead,) = broker.dead_letters["orders"]
    assert "SQLiteSelfDeadlockError" in dead.record.reason
    assert "write through ctx.session" in dead.record.reason
    assert elapsed < 10, f"took {elapsed:.1f} s"


def test_a_handler_reading_through_its_own_sqlite_connection_still_works(
    sqlite_engine: Engine,
) -> None:
    from sqlalchemy import create_engine as plain_engine

    reader = plain_engine(str(sqlite_engine.url))  # deferred transactions: a WAL reader

    class Reads(Orders):
        def handle(self, message: Message, ctx: Context) -> Any:
            with reader.connect() as connection:
                connection.execute(select(func.count()).select_from(orders)).scalar_one()
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish(broker, ["m1", "m2"])
    run_until_idle(Reads(), broker.transport("orders"), sqlite_engine)
    reader.dispose()
    assert order_counts(sqlite_engine) == {"m1": 1, "m2": 1}


def test_the_handler_busy_timeout_is_restored_afterwards(sqlite_engine: Engine) -> None:
    own = create_engine(str(sqlite_engine.url), pool_size=1, max_overflow=0)

    refused: list[str] = []

    class Peeks(Orders):
        def handle(self, message: Message, ctx: Context) -> Any:
            try:  # mqdedup's engines begin with BEGIN IMMEDIATE: refused within a second
                with own.connect() as connection:
                    connection.exec_driver_sql("SELECT 1")
            except OperationalError as error:
                refused.append(type(error.orig).__name__)
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish(broker, ["m1"])
    run_until_idle(Peeks(), broker.transport("orders"), sqlite_engine)
    assert refused == ["OperationalError"] and order_counts(sqlite_engine) == {"m1": 1}
    with own.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 30000
    own.dispose()


def test_a_consumer_without_deduplicate_keeps_its_plain_session(sqlite_engine: Engine) -> None:
    class Plain(Consumer):
        name = "plain"
        poll_timeout = 0.05

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id))

    broker = InMemoryBroker()
    publish(broker, ["m1"])
    run_until_idle(Plain(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m1": 1}


def test_a_dead_letter_reason_is_always_storable_text(sqlite_engine: Engine) -> None:
    class Raises(Orders):
        def handle(self, message: Message, ctx: Context) -> Any:
            raise ValueError("bad \x00 and \ud800")

    broker = InMemoryBroker()
    publish(broker, ["m1"])
    run_until_idle(Raises(), broker.transport("orders"), sqlite_engine)
    (dead,) = broker.dead_letters["orders"]
    for text in (dead.record.reason, dead.record.error_message or ""):
        assert "\x00" not in text and text.encode("utf-8")
        assert "bad \\x00 and \\ud800" in text


def test_data_errors_are_recognised_by_code_not_text() -> None:
    import sqlite3

    from mqdedup.db.dialects import is_data_error, is_sqlite_lock_error, is_transient

    connection = sqlite3.connect(":memory:")
    connection.execute("CREATE TABLE t (k TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    connection.execute("INSERT INTO t VALUES ('a', 1)")
    with pytest.raises(sqlite3.IntegrityError) as duplicate:
        connection.execute("INSERT INTO t VALUES ('a', 2)")
    with pytest.raises(sqlite3.IntegrityError) as not_null:
        connection.execute("INSERT INTO t VALUES ('b', NULL)")
    with pytest.raises(UnicodeEncodeError) as surrogate:
        connection.execute("INSERT INTO t VALUES (?, 1)", ("\ud800",))
    connection.close()
    for error in (duplicate.value, not_null.value, surrogate.value):
        assert is_data_error(error) and not is_transient(error)
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = duplicate.value
    assert is_data_error(wrapped), "found along the cause chain"
    assert not is_data_error(RuntimeError("NUL bytes: DataError 22021"))  # text is ignored
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = 5  # type: ignore[attr-defined]
    assert is_sqlite_lock_error(busy) and not is_data_error(busy)
