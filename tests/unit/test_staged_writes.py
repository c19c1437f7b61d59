"""Staged writes (``ctx.stage``) on SQLite and the in-memory broker.

Rows staged by per-message handlers are written once per batch; a staged row that fails
at the batch end fails its own message alone (retried, then dead-lettered with the
reason) while its batch-mates commit once, with their results and outbox rows.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
from sqlalchemy import Engine, bindparam, func, insert, select, update

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.consumers.staging import StagedWriteError
from mqdedup.db.schema import schema
from tests.support import order_counts, orders

FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
SET_AMOUNT = (
    update(orders)
    .where(orders.c.message_id == bindparam("b_id"))
    .values(amount=bindparam("b_amount"))
)


class StagedOrders(Consumer):
    """Stages one order row and one update of it; ``bad_ids`` stage a NULL message id."""

    name = "staged"
    batch_size = 100
    poll_timeout = 0.01
    retry_policy = FAST_RETRY
    bad_ids: ClassVar[frozenset[str]] = frozenset()
    raising_ids: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        self.calls[message.id] = self.calls.get(message.id, 0) + 1
        number = message.json()["n"]
        row_id = None if message.id in self.bad_ids else message.id
        ctx.stage(orders, {"message_id": row_id, "order_id": str(number), "amount": 0})
        # Runs after the INSERT group (first used later): sets the real amount.
        ctx.stage(SET_AMOUNT, {"b_id": message.id, "b_amount": number})
        ctx.outbox.publish({"n": number}, topic="out")
        if message.id in self.raising_ids:
            raise RuntimeError(f"cannot handle {message.id}")
        return {"n": number}


def publish(broker: InMemoryBroker, count: int) -> None:
    for n in range(count):
        broker.publish("q", json.dumps({"n": n}), message_id=f"m{n}")


def amounts(engine: Engine) -> dict[str, int]:
    with engine.connect() as connection:
        rows = connection.execute(select(orders.c.message_id, orders.c.amount)).all()
    return {row[0]: row[1] for row in rows}


def stored_results(engine: Engine) -> dict[str, Any]:
    table = schema().processed
    with engine.connect() as connection:
        rows = connection.execute(select(table.c.message_id, table.c.result)).all()
    return {row[0]: row[1] for row in rows}


def outbox_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(
            connection.execute(select(func.count()).select_from(schema().outbox)).scalar_one()
        )


@pytest.mark.parametrize("isolation", ["auto", "savepoint", "transaction"])
def test_a_failing_staged_row_fails_its_message_alone(
    sqlite_engine: Engine, isolation: str
) -> None:
    consumer_class = type(
        "Staged", (StagedOrders,), {"bad_ids": frozenset({"m37"}), "failure_isolation": isolation}
    )
    consumer = consumer_class()
    broker = InMemoryBroker()
    publish(broker, 100)
    metrics = run_until_idle(consumer, broker.transport("q"), sqlite_engine)

    good = {f"m{n}" for n in range(100)} - {"m37"}
    assert order_counts(sqlite_engine) == dict.fromkeys(good, 1)
    assert amounts(sqlite_engine) == {f"m{n}": n for n in range(100) if n != 37}
    assert stored_results(sqlite_engine) == {f"m{n}": {"n": n} for n in range(100) if n != 37}
    assert outbox_count(sqlite_engine) == 99  # the culprit's outbox row rolled back too
    [letter] = broker.dead_letters["q"]
    assert letter.message.headers["message-id"] == "m37"
    assert "IntegrityError" in letter.record.reason and "NOT NULL" in letter.record.reason
    assert metrics.processed == 99 and metrics.dead_lettered == 1
    assert consumer.calls["m37"] >= FAST_RETRY.max_attempts


@pytest.mark.parametrize("isolation", ["auto", "savepoint"])
def test_a_raising_handler_leaves_no_staged_rows(sqlite_engine: Engine, isolation: str) -> None:
    consumer_class = type(
        "Staged",
        (StagedOrders,),
        {"raising_ids": frozenset({"m5", "m6"}), "failure_isolation": isolation},
    )
    broker = InMemoryBroker()
    publish(broker, 50)
    run_until_idle(consumer_class(), broker.transport("q"), sqlite_engine)

    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in range(50) if n not in (5, 6)}
    assert sorted(str(d.message.headers["message-id"]) for d in broker.dead_letters["q"]) == [
        "m5",
        "m6",
    ]


def test_stage_refuses_what_it_cannot_run_set_based(sqlite_engine: Engine) -> None:
    class Returning(StagedOrders):
        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.stage(insert(orders).returning(orders.c.row_id), {"message_id": message.id})

    broker = InMemoryBroker()
    publish(broker, 1)
    run_until_idle(Returning(), broker.transport("q"), sqlite_engine)
    [letter] = broker.dead_letters["q"]
    assert "RETURNING" in letter.record.reason
    assert order_counts(sqlite_engine) == {}
    with pytest.raises(StagedWriteError, match="not str"):
        from mqdedup.consumers.staging import StagedWrites

        StagedWrites().add("orders", {})  # type: ignore[arg-type]
