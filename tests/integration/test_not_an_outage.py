"""An outage is a database that does not answer (issue 39, promise 6).

Errors that only look like an outage, from a database that answers a probe, belong to
the message: they are isolated, counted toward its attempts and end in the dead-letter
queue with a reason naming the limit; its batch-mates commit and the worker goes on.

* psycopg refuses a statement with more than 65,535 parameters on the client side (an
  ``OperationalError`` without SQLSTATE, like a lost connection);
* MariaDB drops the connection for a row over ``max_allowed_packet``;
* a ``ctx.step`` on an engine whose pool has one connection waits for the connection
  the message's own transaction holds;
* 70,000 stored results read at once for ``on_duplicate``.

Each ran for ever as "database unavailable; retrying" before (the worker never failed
the message). A real outage (a stopped PostgreSQL) still pauses without dead-lettering:
``test_foundation_pg.py::test_database_down_mid_run_pauses_and_resumes_without_loss``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Column, Integer, LargeBinary, MetaData, String, Table, insert, select
from sqlalchemy.dialects.mysql import LONGBLOB

from mqdedup import (
    AsyncConsumer,
    AsyncContext,
    Consumer,
    Context,
    InMemoryBroker,
    Message,
    RetryPolicy,
)
from mqdedup.consumers.worker import Worker
from mqdedup.db import create_engine
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.store import DedupStore
from mqdedup.stopping import StopToken
from tests.services import TestDatabase, prefixed_database, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration

QUEUE = "orders"
FAST = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05)
#: Far below what an endless outage would take; generous for a loaded 2-core machine.
BOUND = 90.0


def publish(broker: InMemoryBroker, ids: Sequence[str]) -> None:
    for message_id in ids:
        broker.publish(QUEUE, json.dumps({"id": message_id}), message_id=message_id)


def run_bounded(consumer: Consumer, broker: InMemoryBroker, engine: Any) -> Worker:
    """Run a worker until the queue is idle, or fail after BOUND seconds (the old
    behaviour: waiting out a non-outage for ever)."""
    stop = StopToken()
    transport = broker.transport(QUEUE)
    worker = Worker(consumer, transport, engine, stop=stop)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: broker.pending(QUEUE) == 0 and transport.in_flight == 0,
            BOUND,
            "every message settled (processed or dead-lettered), not waited out as an outage",
            interval=0.1,
        )
    finally:
        stop.request()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the worker did not stop"
    return worker


def rows(engine: Any, table: Table) -> dict[str, int]:
    with engine.connect() as connection:
        found: dict[str, int] = {}
        for row in connection.execute(select(table.c.message_id)):
            found[row.message_id] = found.get(row.message_id, 0) + 1
        return found


def dead_letters(broker: InMemoryBroker) -> dict[str, str]:
    return {str(d.message.id): d.record.reason for d in broker.dead_letters.get(QUEUE, [])}


# -- psycopg's parameter limit -------------------------------------------------------------

BIG_ROWS = 25_000  # x 3 columns = 75,000 parameters in one INSERT … VALUES


def test_handle_batch_over_the_psycopg_parameter_limit_fails_that_message_alone(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    orders = orders_table(db.prefix)
    ids = [f"m-{n}" for n in range(20)]

    class Bulk(Consumer):
        name = "bulk"
        table_prefix = db.prefix
        batch_size = 20
        poll_timeout = 0.02
        retry_policy = FAST

        def handle_batch(self, messages: Sequence[Message], ctx: Any) -> None:
            # One INSERT … VALUES for the whole batch, 3 parameters per row (driver SQL:
            # SQLAlchemy takes seconds to compile a 25,000-row insert().values()).
            params: list[Any] = []
            for message in messages:
                count = BIG_ROWS if message.id == "m-7" else 1
                params += [message.id, "x", "w"] * count
            rows = ", ".join(["(%s, %s, %s)"] * (len(params) // 3))
            ctx.session.connection().exec_driver_sql(
                f"INSERT INTO {orders.name} (message_id, body, worker) VALUES {rows}",
                tuple(params),
            )

    broker = InMemoryBroker()
    publish(broker, ids)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mqdedup"):
        worker = run_bounded(Bulk(), broker, db.engine)
    took = time.monotonic() - started

    assert rows(db.engine, orders) == {i: 1 for i in ids if i != "m-7"}  # batch-mates commit
    letters = dead_letters(broker)
    assert set(letters) == {"m-7"}
    assert "statement has 75,000 parameters; psycopg allows 65,535" in letters["m-7"]
    assert worker.metrics.database_retries == 0  # never taken for an outage
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    print(f"\n[parameter limit] 20 messages, one over the limit: {took:.1f}s")


def test_70000_stored_results_for_on_duplicate_are_read_in_one_transaction(
    db: TestDatabase,
) -> None:
    """The framework's own read of stored results stays under the limit (chunks)."""
    store = DedupStore(db.prefix)
    ids = [f"d-{n}" for n in range(70_000)]
    table = schema(db.prefix).processed
    now = datetime.now(UTC)
    with db.engine.begin() as connection:
        connection.execute(
            insert(table),
            [
                {"consumer_name": "c", "message_id": i, "result": {"n": n}, "processed_at": now}
                for n, i in enumerate(ids[:3])
            ],
        )
    from sqlalchemy.orm import Session

    with Session(db.engine) as session:
        found = store.results(session, "c", ids)
    assert found == {"d-0": {"n": 0}, "d-1": {"n": 1}, "d-2": {"n": 2}}


# -- MariaDB's max_allowed_packet ----------------------------------------------------------


def blobs_table(prefix: str) -> Table:
    return Table(
        f"{prefix}blobs",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("body", LargeBinary().with_variant(LONGBLOB(), "mysql", "mariadb")),
    )


@pytest.fixture
def maria(mariadb_url: str) -> Iterator[tuple[TestDatabase, Table]]:
    from tests.services import table_prefix

    prefix = table_prefix()
    blobs = blobs_table(prefix)
    with prefixed_database(mariadb_url, "MariaDB", blobs.metadata, prefix=prefix) as database:
        yield database, blobs


def test_a_row_over_max_allowed_packet_is_dead_lettered_and_its_batch_mates_commit(
    maria: tuple[TestDatabase, Table], caplog: pytest.LogCaptureFixture
) -> None:
    database, blobs = maria
    with database.engine.connect() as connection:
        packet = int(connection.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
    assert packet <= 64 * 1024 * 1024, "the test sends a row just over the server's limit"
    too_big = b"x" * (packet + 1024 * 1024)
    ids = [f"m-{n}" for n in range(12)]

    class Blobs(Consumer):
        name = "blobs"
        table_prefix = database.prefix
        batch_size = 12
        poll_timeout = 0.02
        retry_policy = FAST

        def handle(self, message: Message, ctx: Context) -> None:
            body = too_big if message.id == "m-5" else b"small"
            ctx.session.execute(insert(blobs).values(message_id=message.id, body=body))

    broker = InMemoryBroker()
    publish(broker, ids)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mqdedup"):
        worker = run_bounded(Blobs(), broker, database.engine)
    took = time.monotonic() - started

    assert rows(database.engine, blobs) == {i: 1 for i in ids if i != "m-5"}
    letters = dead_letters(broker)
    assert set(letters) == {"m-5"}
    assert "max_allowed_packet" in letters["m-5"] and "not an outage" in letters["m-5"]
    assert worker.metrics.dead_lettered == 1
    print(f"\n[max_allowed_packet] 12 messages, one {len(too_big):,} bytes: {took:.1f}s")


# -- a step on a pool of one ---------------------------------------------------------------


def test_a_step_on_a_pool_of_one_fails_its_message_with_the_pool_named(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """The message's transaction holds the only connection; the step's wait is the
    message's failure (the pool named, too small by one), never an endless outage; the
    worker counts it and is not ready until a message commits again."""
    engine = create_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    orders = orders_table(db.prefix)
    calls: list[str] = []

    class Charging(Consumer):
        name = "charging"
        table_prefix = db.prefix
        batch_size = 5
        poll_timeout = 0.02
        retry_policy = FAST

        def handle(self, message: Message, ctx: Context) -> None:
            if message.id == "m-2":
                ctx.step("charge", lambda key: calls.append(key) or {"ok": True})
            ctx.session.execute(insert(orders).values(message_id=message.id, body="x"))

    broker = InMemoryBroker()
    ids = [f"m-{n}" for n in range(5)]
    publish(broker, ids)
    shortage: list[str | None] = []
    try:
        with caplog.at_level(logging.WARNING, logger="mqdedup"):
            worker = run_bounded(Charging(), broker, engine)
    finally:
        engine.dispose()
    shortage.append(worker.metrics.connection_shortage)

    assert rows(db.engine, orders) == {i: 1 for i in ids if i != "m-2"}
    letters = dead_letters(broker)
    assert set(letters) == {"m-2"}
    assert "too small by 1" in letters["m-2"] and "at least 2 connections" in letters["m-2"]
    assert "while all 1 were checked out" in letters["m-2"]
    assert calls == []  # the external call never ran: the step never got its connection
    assert worker.metrics.pool_timeouts >= 3
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("too small by 1" in line for line in errors), errors
    starts = [
        r.getMessage() for r in caplog.records if "gives 1 connection at once" in r.getMessage()
    ]
    assert len(starts) == 1 and "too small by 1 for a handler that uses ctx.step" in starts[0]


def test_an_async_step_on_a_pool_of_one_fails_its_message_with_the_pool_named(
    db: TestDatabase,
) -> None:
    """The same through an AsyncEngine: the probe runs inside the asyncio bridge."""
    orders = orders_table(db.prefix)

    class AsyncCharging(AsyncConsumer):
        name = "async-charging"
        table_prefix = db.prefix
        batch_size = 5
        poll_timeout = 0.02
        retry_policy = FAST

        async def handle(self, message: Message, ctx: AsyncContext) -> None:
            if message.id == "m-2":
                await ctx.step("charge", lambda key: {"ok": True})
            await ctx.session.execute(insert(orders).values(message_id=message.id, body="a"))

    broker = InMemoryBroker()
    ids = [f"m-{n}" for n in range(5)]
    publish(broker, ids)

    async def scenario() -> None:
        engine = create_async_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=0.5)
        try:
            worker = Worker(AsyncCharging(), broker.transport(QUEUE), engine)
            await asyncio.wait_for(worker.run_async(until_idle=True), BOUND)
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    assert rows(db.engine, orders) == {i: 1 for i in ids if i != "m-2"}
    letters = dead_letters(broker)
    assert set(letters) == {"m-2"} and "too small by 1" in letters["m-2"]
