"""A handler's ``ctx.session`` writes on SQLite: executed when called, in order.

Every ``ctx.session.execute()`` runs at once and returns its real result: a read sees
the writes before it, a ``rowcount`` is the real one (also when kept across calls), and
a failing write fails its message alone (retried, then dead-lettered).
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

    name = "plain"
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


def test_every_statement_runs_when_it_is_called(sqlite_engine: Engine) -> None:
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
    # Per message an order row, then an outbox row: 200 inserts, in the handlers' order.
    assert len(statements) == 200
    assert all(s.startswith(f"INSERT INTO {orders.name}") for s in statements[::2])


class KeepsResults(Consumer):
    """Reads, in each call, the result its previous call kept."""

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


def test_a_result_read_across_handler_calls_is_real(sqlite_engine: Engine) -> None:
    consumer = KeepsResults()
    broker = InMemoryBroker()
    for n in range(120):
        broker.publish("q", json.dumps({"n": n}), message_id=f"m{n}")
    metrics = run_until_idle(consumer, broker.transport("q"), sqlite_engine)

    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in range(120)}
    assert metrics.processed == 120 and metrics.failures == 0 and metrics.dead_lettered == 0
    assert {value["previous"] for value in stored_results(sqlite_engine).values()} <= {None, 0}
    with sqlite_engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(orders)).scalar_one() == 120


class BatchThenSingle(Consumer):
    """``handle_batch`` fails for the whole batch when one message is poison; ``handle``
    names the message. Retries run the message alone through ``handle``."""

    name = "batch-then-single"
    batch_size = 10
    poll_timeout = 0.01
    retry_policy = FAST_RETRY

    def handle_batch(self, messages: Any, ctx: Any) -> None:
        if any(m.id == "m3" for m in messages):
            raise ValueError("a message of this batch cannot be handled")
        for message in messages:
            ctx.session.execute(insert(orders), {"message_id": message.id, "amount": 1})

    def handle(self, message: Message, ctx: Context) -> None:
        if message.id == "m3":
            raise ValueError(f"cannot handle {message.id}")
        ctx.session.execute(insert(orders), {"message_id": message.id, "amount": 1})


@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_a_retried_message_runs_alone_through_handle_and_is_dead_lettered_with_its_error(
    sqlite_engine: Engine, isolation: str
) -> None:
    consumer = type("B", (BatchThenSingle,), {"failure_isolation": isolation})()
    broker = InMemoryBroker()
    publish(broker, 6)
    metrics = run_until_idle(consumer, broker.transport("q"), sqlite_engine)

    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in range(6) if n != 3}
    [letter] = broker.dead_letters["q"]
    assert letter.record.reason == (
        f"handler failed after {FAST_RETRY.max_attempts} attempts: ValueError: cannot handle m3"
    )
    assert metrics.processed == 5 and metrics.dead_lettered == 1
