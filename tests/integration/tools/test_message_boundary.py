"""One message, one fate, on real PostgreSQL and MariaDB (issue 12, items 1-4).

What a producer puts in a message id, what a handler returns and what it does with
``ctx.session`` decide that message's outcome alone: the message is dead-lettered with
a reason that names the problem, its batch-mates commit, the processor never raises,
and both databases give the same answer. Each test here failed on the code before the
per-message boundary (a ``DataError`` / ``UnicodeEncodeError`` escaping ``process()``,
silently lost messages, or a database-specific outcome).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text

from mqdedup import InMemoryBroker, Message, RetryPolicy, ids, run_until_idle
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from mqdedup.errors import ConfigurationError
from tests.integration.tools.conftest import Database

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)


def order_consumer(db: Database, **attributes: Any) -> Consumer:
    """Writes one row per message into the test's orders table and returns a result."""
    orders = db.business.orders

    class Orders(Consumer):
        name = "orders"
        batch_size = 100
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = db.prefix

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id))
            return {"stored": message.id}

    for key, value in attributes.items():
        setattr(Orders, key, value)
    return Orders()


def publish(broker: InMemoryBroker, message_ids: list[str], queue: str = "orders") -> None:
    for number, message_id in enumerate(message_ids):
        broker.publish(queue, json.dumps({"order": number}), headers={"message-id": message_id})


def claims(db: Database) -> dict[str, Any]:
    """Claimed message ids of this test's consumer, with their stored results."""
    table = schema(db.prefix).processed
    with db.engine.connect() as connection:
        rows = connection.execute(select(table.c.message_id, table.c.result)).all()
    return {row[0]: row[1] for row in rows}


GOOD = ["good-1", "good-2", "good-3", "good-4"]


@pytest.mark.parametrize(
    ("bad_id", "reason"),
    [
        ("bad\x00id", "message id contains a NUL byte ('message-id' header)"),
        ("a\ud800b", "message id is not valid Unicode: a lone surrogate at position 1"),
        ("", "missing message id: empty 'message-id' header"),
        ("x" * 300, "message id is longer than 255 characters (300, 'message-id' header)"),
    ],
    ids=["nul", "surrogate", "empty", "too-long"],
)
@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_an_invalid_message_id_is_dead_lettered_and_its_batch_mates_commit(
    database: Database, bad_id: str, reason: str, isolation: str
) -> None:
    broker = InMemoryBroker()
    publish(broker, [GOOD[0], GOOD[1], bad_id, GOOD[2], GOOD[3]])
    consumer = order_consumer(database, failure_isolation=isolation)

    metrics = run_until_idle(consumer, broker.transport("orders"), database.engine)

    assert database.business.order_counts(database.engine) == dict.fromkeys(GOOD, 1)
    assert set(claims(database)) == set(GOOD)
    (dead,) = broker.dead_letters["orders"]
    assert reason in dead.record.reason and dead.record.attempts == 1
    assert dead.message.headers["message-id"] == bad_id, "original message kept"
    assert (metrics.processed, metrics.dead_lettered, broker.pending("orders")) == (4, 1, 0)


@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_from_callable_ids_are_checked_like_any_id(database: Database, isolation: str) -> None:
    def reference(message: Message) -> str:
        return str(message.json()["ref"])  # KeyError without a ref

    broker = InMemoryBroker()
    for ref in ("r1", "bad\x00ref", None, "r2", "y" * 256):
        broker.publish("orders", json.dumps({} if ref is None else {"ref": ref}))
    consumer = order_consumer(
        database,
        failure_isolation=isolation,
        message_id_strategy=ids.from_callable(reference),
    )

    run_until_idle(consumer, broker.transport("orders"), database.engine)

    assert database.business.order_counts(database.engine) == {"r1": 1, "r2": 1}
    reasons = [d.record.reason for d in broker.dead_letters["orders"]]
    assert reasons == [
        "message id contains a NUL byte (id from reference)",
        "the message id strategy failed: KeyError: 'ref'",
        "message id is longer than 255 characters (256, id from reference)",
    ]


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (math.nan, "handler result is not strict JSON"),
        ({"total": math.inf}, "handler result is not strict JSON"),
        ({"note": "a\x00b"}, "handler result contains a NUL character"),
        (["\udc80"], "handler result is not valid Unicode"),
    ],
    ids=["nan", "inf", "nul", "surrogate"],
)
@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_a_result_the_database_cannot_store_fails_only_its_message(
    database: Database, result: Any, reason: str, isolation: str
) -> None:
    orders = database.business.orders

    class BadResult(Consumer):
        name = "orders"
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = database.prefix
        failure_isolation = isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id))
            return result if message.id == "bad" else {"ok": message.id}

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad", "good-2"])
    run_until_idle(BadResult(), broker.transport("orders"), database.engine)

    assert database.business.order_counts(database.engine) == {"good-1": 1, "good-2": 1}
    assert claims(database) == {"good-1": {"ok": "good-1"}, "good-2": {"ok": "good-2"}}
    (dead,) = broker.dead_letters["orders"]
    assert reason in dead.record.reason and dead.record.attempts == 1


def test_a_consumer_name_longer_than_the_column_is_refused_at_start(pg: Database) -> None:
    broker = InMemoryBroker()
    publish(broker, GOOD)
    consumer = order_consumer(pg, name="n" * 300)
    with pytest.raises(ConfigurationError, match="consumer name is 300 characters long"):
        run_until_idle(consumer, broker.transport("orders"), pg.engine)
    assert broker.pending("orders") == 4 and claims(pg) == {}


def test_coordinates_of_a_249_character_topic_past_offset_999_are_valid_ids(
    pg: Database,
) -> None:
    topic = "t" * 249  # the longest name Kafka allows
    broker = InMemoryBroker()
    for number in range(1001):
        broker.publish(topic, json.dumps({"order": number}))
    consumer = order_consumer(pg, message_id_strategy=ids.from_coordinates, batch_size=500)

    metrics = run_until_idle(consumer, broker.transport(topic), pg.engine)

    assert metrics.processed == 1001 and metrics.dead_lettered == 0
    claimed = claims(pg)
    assert len(claimed) == 1001 and max(len(i) for i in claimed) <= ids.MAX_ID_LENGTH
    assert f"{topic}/0/999" in claimed, "short enough coordinates stay as they are"
    assert next(i for i in claimed if i.endswith("/0/1000")).startswith("topic-sha256:")


@pytest.mark.parametrize("method", ["commit", "rollback", "close", "begin"])
@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_a_handler_that_ends_the_transaction_fails_only_its_message(
    pg: Database, method: str, isolation: str
) -> None:
    orders = pg.business.orders

    class EndsIt(Consumer):
        name = "orders"
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = pg.prefix
        failure_isolation = isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id))
            ctx.outbox.publish({"order": message.id}, topic="events")
            if message.id == "bad":
                getattr(ctx.session, method)()
            return None

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad", "good-2"])
    metrics = run_until_idle(EndsIt(), broker.transport("orders"), pg.engine)

    assert pg.business.order_counts(pg.engine) == {"good-1": 1, "good-2": 1}
    assert set(claims(pg)) == {"good-1", "good-2"}
    assert pg.count(schema(pg.prefix).outbox) == 2, "the outbox works on the guarded session"
    (dead,) = broker.dead_letters["orders"]
    assert f"a handler must not end the transaction: ctx.session.{method}()" in (dead.record.reason)
    assert dead.record.attempts == FAST_RETRY.max_attempts
    assert (metrics.processed, metrics.duplicates, metrics.dead_lettered) == (2, 0, 1)


@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_a_data_error_at_commit_is_attributed_to_its_message(pg: Database, isolation: str) -> None:
    """A deferred foreign key fails at COMMIT, outside any handler: the batch is split,
    the culprit follows the retry policy, its batch-mates commit."""
    parents, children = f"{pg.prefix}parents", f"{pg.prefix}children"
    with pg.engine.begin() as connection:
        connection.execute(text(f"CREATE TABLE {parents} (id text PRIMARY KEY)"))
        connection.execute(
            text(
                f"CREATE TABLE {children} (message_id text PRIMARY KEY, parent text "
                f"REFERENCES {parents} (id) DEFERRABLE INITIALLY DEFERRED)"
            )
        )
        connection.execute(text(f"INSERT INTO {parents} VALUES ('p')"))

    class Deferred(Consumer):
        name = "orders"
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = pg.prefix
        failure_isolation = isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            parent = "missing" if message.id == "bad" else "p"
            ctx.session.execute(
                text(f"INSERT INTO {children} VALUES (:id, :parent)"),
                {"id": message.id, "parent": parent},
            )
            return {"ok": True}

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad", "good-2"])
    try:
        metrics = run_until_idle(Deferred(), broker.transport("orders"), pg.engine)
        with pg.engine.connect() as connection:
            stored = connection.execute(text(f"SELECT message_id FROM {children}")).scalars()
            assert sorted(stored) == ["good-1", "good-2"]
    finally:
        with pg.engine.begin() as connection:
            connection.execute(text(f"DROP TABLE {children}, {parents}"))

    assert set(claims(pg)) == {"good-1", "good-2"}
    (dead,) = broker.dead_letters["orders"]
    assert "ForeignKeyViolation" in dead.record.reason
    assert dead.record.attempts == FAST_RETRY.max_attempts
    assert (metrics.processed, metrics.dead_lettered) == (2, 1)


def test_a_handler_error_text_with_a_nul_byte_is_counted(pg: Database) -> None:
    """The failed attempt is recorded although its error text has a NUL (PostgreSQL
    refuses NUL in text): the counter keeps working and the message is dead-lettered."""

    class Raises(Consumer):
        name = "orders"
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = pg.prefix

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "bad":
                raise ValueError("bad value \x00 \ud800")
            return None

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad"])
    run_until_idle(Raises(), broker.transport("orders"), pg.engine)
    (dead,) = broker.dead_letters["orders"]
    assert dead.record.attempts == FAST_RETRY.max_attempts
    attempts = schema(pg.prefix).attempts
    with pg.engine.connect() as connection:
        row = connection.execute(select(attempts.c.attempts, attempts.c.last_error)).one()
    assert row[0] == FAST_RETRY.max_attempts and "\\x00" in row[1]
    assert set(claims(pg)) == {"good-1"}
    with pg.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(attempts)).scalar_one() == 1


def test_a_redelivered_message_whose_error_text_has_a_nul_is_dead_lettered(
    pg: Database,
) -> None:
    """Careful mode (redelivered messages) records the error text before the retry:
    a NUL byte in it must not crash the worker on PostgreSQL."""

    class Raises(Consumer):
        name = "orders"
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = pg.prefix

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "bad":
                raise ValueError("bad value \x00 \ud800")
            return None

    broker = InMemoryBroker()
    publish(broker, ["good-1", "bad"])
    broker.transport("orders").close()  # nothing fetched yet: nothing comes back
    first = broker.transport("orders")
    assert len(first.fetch(10, 1.0)) == 2
    first.close()  # a worker died holding them: both come back redelivered
    run_until_idle(Raises(), broker.transport("orders"), pg.engine)

    (dead,) = broker.dead_letters["orders"]
    assert dead.message.redelivered and dead.record.attempts == FAST_RETRY.max_attempts
    assert "bad value \\x00" in dead.record.reason
    assert set(claims(pg)) == {"good-1"}
