"""Per-message handlers in a psycopg pipeline (``pipeline_handlers``), real PostgreSQL.

Writes are sent without waiting; everything a handler reads still answers as without
the pipeline: a SELECT sees the batch's earlier writes, ``rowcount`` is the real count,
a caught error in a savepoint stays the handler's own business, a generated key is
returned. A write that fails shows later, so the batch runs again without the pipeline
and the failing message fails alone.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from sqlalchemy import Table, bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers import pipelining
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from tests.integration.rabbitmq.support import order_counts
from tests.services import TestDatabase, prefixed_database, table_prefix
from tests.support import orders_table

pytestmark = pytest.mark.integration


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    prefix = table_prefix()
    with prefixed_database(
        pg_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix
    ) as database:
        yield database


class Mixed(Consumer):
    """Each message writes its row, then does what its ``kind`` says."""

    name = "pipelined"
    batch_size = 100
    poll_timeout = 0.01
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
    orders: ClassVar[Table]

    def handle(self, message: Message, ctx: Context) -> Any:
        kind = message.json()["kind"]
        orders = self.orders
        body = "x" * 5000 if kind == "bad" else kind  # VARCHAR(2000): 22001 for "bad"
        row = {"message_id": message.id, "body": body}
        if kind == "catch":
            row["row_id"] = -1  # taken, for the insert below to collide with
        ctx.session.execute(insert(orders), row)
        if kind == "count":  # an UPDATE's rowcount is the real one, executemany's too
            updated = ctx.session.execute(
                update(orders).where(orders.c.message_id == message.id).values(worker="w")
            )
            many = ctx.session.execute(
                update(orders).where(orders.c.message_id == bindparam("b_id")),
                [{"b_id": message.id, "worker": "x"}, {"b_id": "nobody", "worker": "y"}],
            )
            return {"rowcount": updated.rowcount, "many": many.rowcount}
        if kind == "read":  # a read sees the batch's earlier (pipelined) writes
            seen = ctx.session.execute(select(func.count()).select_from(orders)).scalar_one()
            return {"seen": seen > 0}
        if kind == "catch":  # an error caught in a savepoint stays the handler's own
            try:
                with ctx.session.begin_nested():
                    ctx.session.execute(insert(orders), {"row_id": -1, "message_id": "dup"})
            except IntegrityError:
                return {"caught": True}
            return {"caught": False}
        return None


def publish(broker: InMemoryBroker, kinds: list[str]) -> list[str]:
    ids = []
    for number, kind in enumerate(kinds):
        broker.publish("q", json.dumps({"kind": kind}), message_id=f"{kind}-{number}")
        ids.append(f"{kind}-{number}")
    return ids


def results(db: TestDatabase) -> dict[str, Any]:
    processed = schema(db.prefix).processed
    with db.engine.connect() as connection:
        rows = connection.execute(select(processed.c.message_id, processed.c.result)).all()
    return {row[0]: row[1] for row in rows}


@pytest.fixture
def pipelined_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the handler passes that ran in a pipeline to the end without an error."""
    passes: list[int] = []
    original = pipelining.pipelined

    @contextlib.contextmanager
    def counting(raw: Any) -> Iterator[None]:
        with original(raw):
            yield
        passes.append(1)

    monkeypatch.setattr(pipelining, "pipelined", counting)
    return passes


def test_reads_answer_as_without_the_pipeline_and_a_failing_write_fails_alone(
    db: TestDatabase, pipelined_passes: list[int]
) -> None:
    consumer = type("M", (Mixed,), {"orders": orders_table(db.prefix), "table_prefix": db.prefix})
    # Batch 1 (100): every kind, all in the pipeline; batch 2 (71) has the bad write.
    kinds = ["plain", "count", "read", "plain"] * 40 + ["catch"] + ["plain"] * 10
    kinds[150] = "bad"
    broker = InMemoryBroker()
    ids = publish(broker, kinds)
    metrics = run_until_idle(consumer(), broker.transport("q"), db.engine)

    good = [i for i in ids if not i.startswith("bad")]
    assert order_counts(db.engine, orders_table(db.prefix)) == dict.fromkeys(good, 1)
    stored = results(db)
    assert set(stored) == set(good)
    assert {stored[i]["rowcount"] for i in good if i.startswith("count")} == {1}
    assert {stored[i]["many"] for i in good if i.startswith("count")} == {1}
    assert {stored[i]["seen"] for i in good if i.startswith("read")} == {True}
    assert [stored[i] for i in good if i.startswith("catch")] == [{"caught": True}]
    [letter] = broker.dead_letters["q"]
    assert letter.message.headers["message-id"] == "bad-150"
    assert "StringDataRightTruncation" in letter.record.reason
    assert metrics.processed == len(good) and metrics.dead_lettered == 1
    assert metrics.failures == 2  # the bad message's two attempts, nothing else
    assert pipelined_passes == [1]  # batch 1 ran pipelined; batch 2 reran without


class ReadsKeys(Mixed):
    """Reads the generated key of its insert (a pipelined insert has none)."""

    def handle(self, message: Message, ctx: Context) -> Any:
        result = ctx.session.execute(insert(self.orders), {"message_id": message.id})
        return {"row_id": result.inserted_primary_key[0]}


def test_a_handler_reading_generated_keys_gets_them(
    db: TestDatabase, pipelined_passes: list[int]
) -> None:
    consumer = type(
        "K", (ReadsKeys,), {"orders": orders_table(db.prefix), "table_prefix": db.prefix}
    )()
    broker = InMemoryBroker()
    ids = publish(broker, ["plain"] * 450)
    metrics = run_until_idle(consumer, broker.transport("q"), db.engine)

    orders = orders_table(db.prefix)
    with db.engine.connect() as connection:
        keys = dict(connection.execute(select(orders.c.message_id, orders.c.row_id)).all())
    assert set(keys) == set(ids)
    assert results(db) == {i: {"row_id": keys[i]} for i in ids}
    assert metrics.processed == 450 and metrics.failures == 0
    assert pipelined_passes == []  # batch 1 fell back; the consumer stopped pipelining
