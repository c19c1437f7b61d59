"""A handler's ``ctx.session`` writes on real PostgreSQL: executed when called, in order.

Everything a handler reads answers as the statements it ran: a SELECT sees the handler's
own and the batch's earlier writes, the ``rowcount`` of an ``ON CONFLICT DO NOTHING``
insert is the real one, ``inserted_primary_key`` is the row's key, an error caught in a
savepoint stays the handler's own, and a write PostgreSQL refuses fails its message
alone (retried, then dead-lettered).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
from sqlalchemy import Table, bindparam, event, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from tests.integration.rabbitmq.support import order_counts
from tests.services import TestDatabase
from tests.support import orders_table

pytestmark = pytest.mark.integration


class Mixed(Consumer):
    """Each message writes its row with a plain execute, then does what its ``kind`` says."""

    name = "writes"
    batch_size = 250
    poll_timeout = 0.01
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
    orders: ClassVar[Table]

    def handle(self, message: Message, ctx: Context) -> Any:
        payload = message.json()
        kind = payload["kind"]
        orders = self.orders
        body = "x" * 5000 if kind == "bad" else kind  # VARCHAR(2000): 22001 for "bad"
        inserted = ctx.session.execute(insert(orders), {"message_id": message.id, "body": body})
        if kind == "key":  # the generated key of its own insert
            return {"row_id": inserted.inserted_primary_key[0]}
        if kind == "upsert":  # the real rowcount of an ON CONFLICT DO NOTHING insert
            upsert = (
                pg_insert(orders)
                .on_conflict_do_nothing()
                .execution_options(preserve_rowcount=True)  # SQLAlchemy: INSERT rowcount
            )
            result = ctx.session.execute(upsert, {"row_id": -1, "message_id": "upsert"})
            return {"rowcount": result.rowcount}
        if kind == "count":  # an UPDATE's rowcount, an executemany's too
            updated = ctx.session.execute(
                update(orders).where(orders.c.message_id == message.id).values(worker="w")
            )
            many = ctx.session.execute(
                update(orders).where(orders.c.message_id == bindparam("b_id")),
                [{"b_id": message.id, "worker": "x"}, {"b_id": "nobody", "worker": "y"}],
            )
            return {"rowcount": updated.rowcount, "many": many.rowcount}
        if kind == "read":  # a read sees its own and the batch's earlier writes
            count = select(func.count()).select_from(orders)
            own = ctx.session.execute(count.where(orders.c.message_id == message.id))
            return {"own": own.scalar_one(), "all": ctx.session.scalar(count)}
        if kind == "catch":  # an error caught in a savepoint stays the handler's own
            try:
                with ctx.session.begin_nested():
                    ctx.session.execute(insert(orders), {"row_id": -1, "message_id": "dup"})
            except IntegrityError:
                return {"caught": True}
            return {"caught": False}
        return None


def publish(broker: InMemoryBroker, kinds: list[str], start: int = 0) -> list[str]:
    ids = []
    for number, kind in enumerate(kinds, start):
        broker.publish("q", json.dumps({"kind": kind}), message_id=f"{kind}-{number}")
        ids.append(f"{kind}-{number}")
    return ids


def results(db: TestDatabase) -> dict[str, Any]:
    processed = schema(db.prefix).processed
    with db.engine.connect() as connection:
        rows = connection.execute(select(processed.c.message_id, processed.c.result)).all()
    return {row[0]: row[1] for row in rows}


def test_reads_answer_as_if_written_at_once_and_a_failing_write_fails_alone(
    db: TestDatabase,
) -> None:
    orders = orders_table(db.prefix)
    consumer = type("M", (Mixed,), {"orders": orders, "table_prefix": db.prefix})()
    inserts: list[int] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def count_inserts(*args: Any) -> None:
        if args[2].startswith(f"INSERT INTO {orders.name}"):
            inserts.append(1)

    # Batch 1 (250): every kind; every statement runs when called.
    kinds = ["plain"] * 250
    kinds[10], kinds[20], kinds[30], kinds[40] = "upsert", "read", "key", "count"
    kinds[50], kinds[60], kinds[249] = "upsert", "catch", "read"
    broker = InMemoryBroker()
    first = publish(broker, kinds)
    metrics = run_until_idle(consumer, broker.transport("q"), db.engine)
    assert metrics.processed == 250 and metrics.failures == 0
    batch_one_inserts = len(inserts)
    assert batch_one_inserts >= 250  # one per message at least: nothing batched behind

    # Batch 2 (250): one write PostgreSQL refuses among 249 good ones.
    second = publish(broker, ["plain"] * 100 + ["bad"] + ["plain"] * 149, start=250)
    metrics = run_until_idle(consumer, broker.transport("q"), db.engine)

    good = [i for i in first + second if not i.startswith("bad")]
    counts = order_counts(db.engine, orders)
    assert {i: counts.get(i) for i in good} == dict.fromkeys(good, 1)
    assert counts.get("bad-350") is None
    assert counts["upsert"] == 1  # the first upsert's row; the second found it
    stored = results(db)
    assert set(stored) == set(good)
    assert [stored["upsert-10"], stored["upsert-50"]] == [{"rowcount": 1}, {"rowcount": 0}]
    assert stored["read-20"] == {"own": 1, "all": 21 + 1}  # 21 rows before it, one upsert
    assert stored["read-249"]["own"] == 1 and stored["read-249"]["all"] == 250 + 1
    with db.engine.connect() as connection:
        key = connection.execute(
            select(orders.c.row_id).where(orders.c.message_id == "key-30")
        ).scalar_one()
    assert stored["key-30"] == {"row_id": key}
    assert stored["count-40"] == {"rowcount": 1, "many": 1}
    assert stored["catch-60"] == {"caught": True}
    [letter] = broker.dead_letters["q"]
    assert letter.message.headers["message-id"] == "bad-350"
    assert "StringDataRightTruncation" in letter.record.reason
    assert metrics.processed == 249 and metrics.dead_lettered == 1
    assert metrics.failures == 2  # the bad message's two attempts, nothing else
