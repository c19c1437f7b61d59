"""Async consumers on real PostgreSQL through psycopg 3's asyncio mode.

The in-memory broker feeds an ``AsyncConsumer`` whose handler writes through
``ctx.session`` (an ``AsyncSession``); the database is the shared PostgreSQL, under a
table prefix of the test's own. The outage test puts a TCP proxy on the worker's own
event loop between the worker and PostgreSQL and cuts it (live connections aborted,
new ones refused): the shared database itself is never stopped. The proxy only works
while the worker leaves the loop free (every database wait is awaited).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from mqdedup import AsyncConsumer, AsyncContext, InMemoryBroker, Message, RetryPolicy, StopToken
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from mqdedup.outbox import AsyncOutboxWriter, Relay, RelayConfig
from mqdedup.outbox.memory import MemoryPublisher
from tests.integration.asyncio.proxy import CuttableProxy
from tests.services import TestDatabase, prefixed_database, table_prefix, wait_for_on_loop

pytestmark = pytest.mark.integration

QUEUE = "orders"


def orders_with_unique_numbers(prefix: str) -> Table:
    """One row per order; the order number is unique (a business constraint)."""
    return Table(
        f"{prefix}async_orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("order_no", Integer, nullable=False, unique=True),
    )


@pytest.fixture
def db(pg_url: str) -> Iterator[TestDatabase]:
    prefix = table_prefix()
    with prefixed_database(
        pg_url, "PostgreSQL", orders_with_unique_numbers(prefix).metadata, prefix=prefix
    ) as database:
        yield database


def consumer_class(prefix: str) -> type[AsyncConsumer]:
    table = orders_with_unique_numbers(prefix)

    class Orders(AsyncConsumer):
        name = "async-orders"
        table_prefix = prefix
        batch_size = 20
        poll_timeout = 0.05
        retry_policy = RetryPolicy(
            max_attempts=2, initial_backoff=0.05, infrastructure_backoff_max=0.5
        )

        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            number = message.json()["order_no"]
            await ctx.session.execute(insert(table).values(message_id=message.id, order_no=number))
            await ctx.outbox.publish({"order_no": number}, topic="order-events")
            return {"order_no": number}

    return Orders


def row_counts(db: TestDatabase) -> dict[str, int]:
    table = orders_with_unique_numbers(db.prefix)
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


def outbox_rows(db: TestDatabase) -> int:
    with db.engine.connect() as connection:
        return int(
            connection.execute(select(func.count()).select_from(schema(db.prefix).outbox)).scalar()
        )


def publish(broker: InMemoryBroker, count: int, number: Callable[[int], int] = int) -> list[str]:
    ids = [f"order-{n}" for n in range(count)]
    for n, message_id in enumerate(ids):
        broker.publish(QUEUE, f'{{"order_no": {number(n)}}}', message_id=message_id)
    return ids


def test_30pct_duplicates_once_each_and_a_constraint_violation_fails_alone(
    db: TestDatabase,
) -> None:
    broker = InMemoryBroker(seed=3)
    # order-13 repeats order-12's number: its insert breaks the unique constraint.
    ids = publish(broker, 300, lambda n: 12 if n == 13 else n)
    copies = broker.inject_duplicates(QUEUE, 0.3)
    assert copies > 60

    async def scenario() -> None:
        engine = create_async_engine(db.url)
        try:
            await Worker(consumer_class(db.prefix)(), broker.transport(QUEUE), engine).run_async(
                until_idle=True
            )
        finally:
            await engine.dispose()

    asyncio.run(scenario())

    assert row_counts(db) == {i: 1 for i in ids if i != "order-13"}
    assert outbox_rows(db) == 299  # one event per order, none for the failed one
    letters = broker.dead_letters[QUEUE]
    assert {letter.message.headers["message-id"] for letter in letters} == {"order-13"}
    assert all("UniqueViolation" in letter.record.reason for letter in letters)
    assert broker.pending(QUEUE) == 0
    assert broker.settled_count[QUEUE] == 300 + copies


def test_database_outage_pauses_the_async_worker_and_it_resumes_without_loss(
    db: TestDatabase,
) -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 400)
    transport = broker.transport(QUEUE)
    target = make_url(db.url)
    stop = StopToken()
    outage_seen: list[str | None] = []

    async def scenario() -> Worker:
        proxy = CuttableProxy(target.host or "127.0.0.1", target.port or 5432)
        await proxy.open()
        engine = create_async_engine(target.set(host="127.0.0.1", port=proxy.listen_port))
        worker = Worker(consumer_class(db.prefix)(), transport, engine, stop=stop)
        task = asyncio.create_task(worker.run_async())
        try:
            await wait_for_on_loop(
                lambda: worker.metrics.processed >= 60, 30, "the worker to get going"
            )
            await proxy.cut()
            retries = worker.metrics.database_retries
            await asyncio.sleep(1.0)  # the outage lasts a second
            assert not task.done(), "the worker gave up during the outage"
            assert worker.metrics.database_retries >= retries + 3
            outage_seen.append(worker.metrics.outage)
            assert not broker.dead_letters  # an outage is never the message's fault
            await proxy.open()  # the database is back
            await wait_for_on_loop(
                lambda: broker.pending(QUEUE) == 0 and transport.in_flight == 0,
                60,
                "the worker to finish after the database came back",
            )
        finally:
            stop.request()
            await asyncio.wait_for(task, 30)
            await engine.dispose()
            await proxy.cut()
        return worker

    worker = asyncio.run(scenario())

    assert outage_seen[0] is not None and outage_seen[0].startswith("database unavailable")
    assert worker.metrics.outage is None  # ready again
    assert row_counts(db) == dict.fromkeys(ids, 1)
    assert not broker.dead_letters
    assert broker.settled_count[QUEUE] == 400


def test_an_endpoint_style_async_transaction_writes_its_event_and_the_relay_publishes_it(
    db: TestDatabase,
) -> None:
    """``AsyncOutboxWriter`` on a plain ``AsyncSession`` (what a FastAPI endpoint has):
    the order and its event commit together (or not at all), and the relay publishes
    the committed event."""
    table = orders_with_unique_numbers(db.prefix)

    async def place(session: AsyncSession, number: int) -> str:
        async with session.begin():
            await session.execute(insert(table).values(message_id=f"req-{number}", order_no=number))
            return await AsyncOutboxWriter(session, prefix=db.prefix).publish(
                {"order_no": number}, topic="order-placed", key=str(number)
            )

    async def scenario() -> str:
        engine = create_async_engine(db.url)
        try:
            async with AsyncSession(engine) as session:
                event_id = await place(session, 1)
            async with AsyncSession(engine) as session:
                with pytest.raises(IntegrityError):
                    await place(session, 1)  # the same order number again: nothing commits
            return event_id
        finally:
            await engine.dispose()

    event_id = asyncio.run(scenario())

    assert row_counts(db) == {"req-1": 1}
    assert outbox_rows(db) == 1  # the failed transaction's event rolled back with it
    publisher = MemoryPublisher()
    relay = Relay(
        db.engine,
        {"kafka": publisher},
        prefix=db.prefix,
        config=RelayConfig(poll_interval=0.05, listen=False),
    )
    try:
        relay.drain(30)
    finally:
        relay.close()
    assert [record.message_id for record in publisher.published] == [event_id]
