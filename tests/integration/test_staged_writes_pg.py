"""Staged writes (``ctx.stage``) on real PostgreSQL, with real RabbitMQ and Kafka for kill -9.

1. 500 messages, one of which stages a row PostgreSQL refuses: the batch's staged
   INSERT fails at the batch end, the batch runs again writing each message's rows at
   once, and the culprit alone is retried and dead-lettered with the reason; the other
   499 commit their staged rows, outbox rows and stored results once.
2. A worker killed with ``kill -9`` after a batch's staged rows were written and before
   its commit: nothing of that batch survives, the broker redelivers it, the next
   worker writes every message's effects exactly once.
2b. On Kafka, a worker killed with ``kill -9`` after a batch of staged rows committed and
   before its offsets did: the broker redelivers the batch, the claims turn it away,
   every message's row exists once.

The module doubles as the worker process of (2): ``python -m
tests.integration.test_staged_writes_pg '<json config>'``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sqlalchemy import Engine, Table, event, func, select
from sqlalchemy.orm import Session

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, create_engine, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from mqdedup.stopping import StopToken
from tests.integration.kafka.helpers import WorkerProcess, row_counts, total_rows
from tests.integration.rabbitmq.support import OrdersConsumer, claims, order_counts
from tests.services import (
    REPO,
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    TestDatabase,
    kill_session_timeout_ms,
    unique_name,
    wait_for,
)
from tests.support import orders_table

pytestmark = pytest.mark.integration


def outbox_ids(engine: Engine, prefix: str) -> list[str]:
    """The incoming message id each outbox row was written for (its payload)."""
    outbox = schema(prefix).outbox
    with engine.connect() as connection:
        payloads = connection.execute(select(outbox.c.payload)).scalars().all()
    return sorted(json.loads(payload)["id"] for payload in payloads)


def stored_results(engine: Engine, prefix: str) -> dict[str, Any]:
    processed = schema(prefix).processed
    with engine.connect() as connection:
        rows = connection.execute(select(processed.c.message_id, processed.c.result)).all()
    return {row[0]: row[1] for row in rows}


# -- 1. a failing staged write among 500 -------------------------------------------------


class StagedOrders(Consumer):
    """Stages its order row, publishes one outbox row, returns a result."""

    name = "staged-pg"
    batch_size = 500
    poll_timeout = 0.01
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
    orders: ClassVar[Table]
    bad_id: ClassVar[str] = ""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        self.calls[message.id] = self.calls.get(message.id, 0) + 1
        # "body" is a VARCHAR(2000): the bad message's row is too long for it (22001).
        body = "x" * 5000 if message.id == self.bad_id else message.text()
        ctx.stage(self.orders, {"message_id": message.id, "body": body, "worker": "w"})
        ctx.outbox.publish({"id": message.id}, topic="staged-out")
        return {"seen": message.id}


def test_a_failing_staged_write_among_500_fails_alone(db: TestDatabase) -> None:
    orders = orders_table(db.prefix)
    consumer = type(
        "Staged", (StagedOrders,), {"orders": orders, "table_prefix": db.prefix, "bad_id": "m250"}
    )()
    broker = InMemoryBroker()
    ids = [f"m{n}" for n in range(500)]
    for message_id in ids:
        broker.publish("q", json.dumps({"n": message_id}), message_id=message_id)

    metrics = run_until_idle(consumer, broker.transport("q"), db.engine)

    good = [message_id for message_id in ids if message_id != "m250"]
    assert order_counts(db.engine, orders) == dict.fromkeys(good, 1)
    assert outbox_ids(db.engine, db.prefix) == sorted(good)
    assert stored_results(db.engine, db.prefix) == {i: {"seen": i} for i in good}
    [letter] = broker.dead_letters["q"]
    assert letter.message.headers["message-id"] == "m250"
    assert "StringDataRightTruncation" in letter.record.reason
    assert consumer.calls["m250"] == 1 + 1  # the batch, the retry (the rerun leaves it out)
    assert metrics.processed == 499 and metrics.dead_lettered == 1
    assert broker.pending("q") == 0


# -- 2. kill -9 between the staged writes and the commit (RabbitMQ) ----------------------

UNIQUE = 500
COPIES = 100
BATCH = 100
#: The worker holds (to be killed) in the commit of this transaction, after its flush.
HOLD_AT = 3


class StagedRabbitOrders(OrdersConsumer):
    """Stages its row and one outbox row per message."""

    batch_size = BATCH

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        self.calls[message.id] += 1
        ctx.stage(self.orders, {"message_id": message.id, "body": message.text()[:2000]})
        ctx.outbox.publish({"id": message.id}, topic="staged-out")
        return None


def rabbit_consumer(config: dict[str, Any]) -> type[StagedRabbitOrders]:
    namespace = {
        "queue": config["queue"],
        "url": config["url"],
        "table_prefix": config["prefix"],
        "orders": orders_table(config["prefix"]),
        "connection_name": f"mqdedup-test:{config['queue']}",
        "prefetch": 2 * BATCH,
    }
    return type("StagedRabbit", (StagedRabbitOrders,), namespace)


def hold_before_commit(marker: Path, orders: Table) -> None:
    """In the HOLD_AT-th commit: note the rows the transaction sees, then wait."""
    commits = {"count": 0}

    @event.listens_for(Session, "before_commit")
    def before_commit(session: Session) -> None:
        if not session.info.get("mqdedup.refusals"):
            return  # not a processor transaction (attempt counters, dead letters)
        commits["count"] += 1
        if commits["count"] == HOLD_AT:
            seen = session.execute(select(func.count()).select_from(orders)).scalar_one()
            marker.write_text(str(seen))
            threading.Event().wait(120)  # killed long before


def worker_main() -> None:
    config: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    consumer = rabbit_consumer(config)()
    hold_before_commit(Path(config["marker"]), consumer.orders)
    consumer.run(create_engine(config["database_url"]), stop=StopToken())


@pytest.mark.slow
def test_kill_9_after_the_staged_writes_before_the_commit_leaves_each_effect_once(
    rabbitmq_url: str, pg_url: str, db: TestDatabase, tmp_path: Path
) -> None:
    orders = orders_table(db.prefix)
    queue = f"mqdedup-staged-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "holding"
    config = {
        "queue": queue,
        "prefix": db.prefix,
        "url": rabbitmq_url,
        "database_url": pg_url,
        "marker": str(marker),
    }
    admin = RabbitAdmin(rabbitmq_url)
    admin.declare(rabbit_consumer(config)())
    ids = [f"s{number:06d}" for number in range(UNIQUE)]
    admin.publish(queue, ids + [ids[(n * 7) % UNIQUE] for n in range(COPIES)])
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_staged_writes_pg", json.dumps(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: marker.exists() and marker.read_text() != "", 60, "the held commit")
        committed_at_kill = set(order_counts(db.engine, orders))
        process.kill()
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # The held transaction had written its staged rows: it saw more than had committed.
    assert 0 < len(committed_at_kill) < int(marker.read_text())

    consumer = rabbit_consumer(config)()
    stop = StopToken()
    thread = threading.Thread(target=lambda: consumer.run(db.engine, stop=stop), daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: admin.depth(queue) == 0 and len(order_counts(db.engine, orders)) == UNIQUE,
            60,
            "the second worker to finish the queue",
        )
    finally:
        stop.request()
        thread.join(60)
    assert not thread.is_alive()
    counts = order_counts(db.engine, orders)
    assert set(counts) == set(ids) and set(counts.values()) == {1}
    assert claims(db.engine, db.prefix, consumer.consumer_name) == set(ids)
    assert outbox_ids(db.engine, db.prefix) == sorted(ids)
    assert admin.depth(f"{queue}.dlq") == 0
    admin.delete(queue, f"{queue}.dlq")
    admin.close()


# -- 2b. kill -9 between the commit and the offset commit (Kafka) ------------------------


@pytest.mark.slow
def test_kafka_kill_9_after_the_staged_commit_before_the_offsets_leaves_each_effect_once(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    topic = kafka_helper.create_topic(partitions=3)
    ids = [f"k{number:05d}" for number in range(UNIQUE)]
    resent = [ids[(n * 7) % UNIQUE] for n in range(COPIES)]
    kafka_helper.produce(
        topic,
        [Outgoing(m, m.encode(), partition=n % 3) for n, m in enumerate(ids + resent)],
    )
    group = unique_name("staged")
    hold = tmp_path / "held"
    spec: dict[str, Any] = {
        "topic": topic,
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "staged": True,
        "batch_size": BATCH,
        "kafka_config": {"session_timeout_ms": kill_session_timeout_ms(kafka_helper.bootstrap)},
    }
    worker = WorkerProcess(
        {**spec, "hold_file": str(hold), "hold_at": HOLD_AT, "hold_for": 120.0},
        db.url,
        tmp_path,
        "held",
    )
    wait_for(lambda: hold.exists() or worker.process.poll() is not None, 90, "the held batch")
    worker.ensure_alive()
    committed_rows = total_rows(db.engine, db.prefix)
    offsets = sum(o or 0 for o in kafka_helper.committed(group, topic).values())
    worker.kill()
    # The dangerous moment: more rows committed than offsets, so the broker redelivers them.
    assert offsets < committed_rows

    final = WorkerProcess(spec, db.url, tmp_path, "final")
    try:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= UNIQUE, 120, "every message")
        wait_for(
            lambda: kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic),
            60,
            "offsets at the end",
        )
    finally:
        code = final.terminate()
    assert code == 0, final.log_tail()
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(ids, 1)


if __name__ == "__main__":
    worker_main()


# -- 3. the unnest path writes what SQLAlchemy's executemany would ------------------------


def test_staged_rows_of_every_plain_type_arrive_as_sqlalchemy_would_write_them(
    db: TestDatabase,
) -> None:
    from datetime import UTC, date, datetime
    from decimal import Decimal
    from uuid import UUID

    from sqlalchemy import (
        JSON,
        BigInteger,
        Column,
        Date,
        DateTime,
        Float,
        Integer,
        LargeBinary,
        MetaData,
        Numeric,
        String,
        Uuid,
    )
    from sqlalchemy.orm import Session

    from mqdedup.consumers.staging import StagedWrites, _unnest_plan, insert_unnest

    metadata = MetaData()
    columns = [
        Column("name", String(5)),
        Column("small", Integer),
        Column("big", BigInteger),
        Column("price", Numeric(10, 2)),
        Column("ratio", Float),
        Column("day", Date),
        Column("at", DateTime(timezone=True)),
        Column("blob", LargeBinary),
        Column("key", Uuid),
    ]
    fast = Table(
        f"{db.prefix}types_fast", metadata, Column("id", Integer, primary_key=True), *columns
    )
    slow = Table(
        f"{db.prefix}types_slow",  # a JSON column: written by SQLAlchemy's executemany
        metadata,
        Column("id", Integer, primary_key=True),
        *[Column(column.name, column.type) for column in columns],
        Column("doc", JSON),
    )
    metadata.create_all(db.engine)
    at = datetime(2026, 12, 1, 12, 30, tzinfo=UTC)
    rows = [
        {"name": "abc", "small": 7, "big": 2**40, "price": Decimal("1.5"), "ratio": 0.25,
         "day": date(2026, 1, 2), "at": at, "blob": b"\x00\x01", "key": UUID(int=5)},
        {"name": None, "small": None, "big": None, "price": None, "ratio": None,
         "day": None, "at": None, "blob": None, "key": None},
    ]  # fmt: skip
    try:
        with Session(db.engine) as session, session.begin():
            staged = StagedWrites()
            for row in rows:
                staged.add(fast, row)
                staged.add(slow, {**row, "doc": {"a": [1]}})
            staged.flush(session.connection())
        with db.engine.connect() as connection:
            got_fast = connection.execute(select(*fast.c[1:]).order_by(fast.c.id)).all()
            got_slow = connection.execute(select(*slow.c[1:-1]).order_by(slow.c.id)).all()
            docs = connection.execute(select(slow.c.doc)).scalars().all()
        dialect = db.engine.dialect
        assert _unnest_plan(fast, tuple(rows[0]), dialect) is not None  # one unnest INSERT
        assert _unnest_plan(slow, (*rows[0], "doc"), dialect) is None  # executemany
        # Values of another Python type than the column's take SQLAlchemy's path (which
        # writes or refuses them as an immediate execute does): never unnest's arrays.
        with Session(db.engine) as session, session.begin():
            connection = session.connection()
            for odd in ({"name": ["a", "b"]}, {"small": True}, {"ratio": 1}, {"blob": "x"}):
                assert not insert_unnest(connection, fast, [{**rows[0], **odd}, rows[0]])
        assert [tuple(r) for r in got_fast] == [tuple(r) for r in got_slow]
        assert got_fast[0].price == Decimal("1.50") and got_fast[0].at == at
        assert docs == [{"a": [1]}, {"a": [1]}]
        # Too long for String(5): refused like any insert, never cut to fit.
        with (
            pytest.raises(Exception, match="value too long"),
            Session(db.engine) as session,
            session.begin(),
        ):
            staged = StagedWrites()
            staged.add(fast, {**rows[0], "name": "abcdef"})
            staged.add(fast, rows[0])
            staged.flush(session.connection())
    finally:
        metadata.drop_all(db.engine)
