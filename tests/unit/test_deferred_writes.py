"""Deferred plain writes (``defer_writes``) on SQLite: same outcomes as writing at once.

``ctx.session.execute()`` of an insert / update without RETURNING is queued and written
in order, runs of one statement together; a read sees the writes before it, a
``rowcount`` is the real one, a failing deferred row makes the batch run again with
every write made at once so that its message fails alone.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
from sqlalchemy import Engine, bindparam, event, func, insert, select, update

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from tests.support import order_counts, orders
from tests.unit.test_staged_writes import amounts, outbox_count, publish, stored_results

FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
SET_AMOUNT = (
    update(orders)
    .where(orders.c.message_id == bindparam("b_id"))
    .values(amount=bindparam("b_amount"))
)


class PlainOrders(Consumer):
    """Inserts its order row and an outbox row; every 10th reads its row back, every
    10th (5, 15, ...) updates it and returns the rowcount; ``bad_ids`` insert a NULL id."""

    name = "deferred"
    batch_size = 100
    poll_timeout = 0.01
    retry_policy = FAST_RETRY
    bad_ids: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        self.calls[message.id] = self.calls.get(message.id, 0) + 1
        number = message.json()["n"]
        row_id = None if message.id in self.bad_ids else message.id
        amount = 0 if number % 10 == 5 else number
        ctx.session.execute(
            insert(orders), {"message_id": row_id, "order_id": str(number), "amount": amount}
        )
        ctx.outbox.publish({"n": number}, topic="out")
        if number % 10 == 0:  # a read sees this handler's own writes
            own = select(orders.c.amount).where(orders.c.message_id == message.id)
            return {"n": number, "read": ctx.session.execute(own).scalar_one()}
        if number % 10 == 5:
            updated = ctx.session.execute(SET_AMOUNT, {"b_id": message.id, "b_amount": number})
            return {"n": number, "updated": updated.rowcount}
        return {"n": number}


def expected_result(n: int) -> dict[str, int]:
    if n % 10 == 0:
        return {"n": n, "read": n}
    return {"n": n, "updated": 1} if n % 10 == 5 else {"n": n}


@pytest.mark.parametrize("isolation", ["auto", "rerun"])
def test_a_failing_deferred_row_fails_its_message_alone(
    sqlite_engine: Engine, isolation: str
) -> None:
    consumer = type(
        "Plain", (PlainOrders,), {"bad_ids": frozenset({"m37"}), "failure_isolation": isolation}
    )()
    broker = InMemoryBroker()
    publish(broker, 100)
    metrics = run_until_idle(consumer, broker.transport("q"), sqlite_engine)

    good = [n for n in range(100) if n != 37]
    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in good}
    assert amounts(sqlite_engine) == {f"m{n}": n for n in good}
    assert stored_results(sqlite_engine) == {f"m{n}": expected_result(n) for n in good}
    assert outbox_count(sqlite_engine) == 99
    [letter] = broker.dead_letters["q"]
    assert letter.message.headers["message-id"] == "m37"
    assert "IntegrityError" in letter.record.reason and "NOT NULL" in letter.record.reason
    assert metrics.processed == 99 and metrics.dead_lettered == 1


def test_plain_writes_go_in_runs_not_one_statement_each(sqlite_engine: Engine) -> None:
    statements: list[str] = []

    @event.listens_for(sqlite_engine, "before_cursor_execute")
    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        outbox = schema().outbox.name
        if statement.startswith((f"INSERT INTO {orders.name}", f"INSERT INTO {outbox}")):
            statements.append(statement)

    consumer = PlainOrders()
    broker = InMemoryBroker()
    publish(broker, 100)
    run_until_idle(consumer, broker.transport("q"), sqlite_engine)

    assert stored_results(sqlite_engine) == {f"m{n}": expected_result(n) for n in range(100)}
    # Per message an order and an outbox row: 200 inserts at once. Deferred, the
    # inserts into the two (unrelated) tables go in one run each until a handler
    # reads (a result or a SELECT), whose own writes then go one by one.
    assert len(statements) == 80  # per 10 messages: 2 runs, 2 runs, 2 + 2 own inserts


class KeepsResults(Consumer):
    """Reads, in each call, the result its previous call kept (deferral cannot answer)."""

    name = "keeps"
    batch_size = 50
    poll_timeout = 0.01
    retry_policy = FAST_RETRY

    def __init__(self) -> None:
        self.kept: Any = None

    def handle(self, message: Message, ctx: Context) -> Any:
        previous = self.kept
        self.kept = ctx.session.execute(SET_AMOUNT, {"b_id": "nobody", "b_amount": 1})
        count = None if previous is None else previous.rowcount
        ctx.session.execute(insert(orders), {"message_id": message.id, "amount": 0})
        return {"previous": count}


def test_a_result_read_across_handler_calls_stops_the_deferral(sqlite_engine: Engine) -> None:
    consumer = KeepsResults()
    broker = InMemoryBroker()
    for n in range(120):
        broker.publish("q", json.dumps({"n": n}), message_id=f"m{n}")
    metrics = run_until_idle(consumer, broker.transport("q"), sqlite_engine)

    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in range(120)}
    # The rerun's first handler read a result kept from the deferred pass: it failed
    # once (retried alone, it read a real one); nothing else failed.
    assert metrics.processed == 120 and metrics.failures <= 1 and metrics.dead_lettered == 0
    assert {value["previous"] for value in stored_results(sqlite_engine).values()} <= {None, 0}
    with sqlite_engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(orders)).scalar_one() == 120
