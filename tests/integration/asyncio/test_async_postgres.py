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
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.engine import make_url

from mqdedup import AsyncConsumer, AsyncContext, InMemoryBroker, Message, RetryPolicy, StopToken
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from tests.services import TestDatabase, prefixed_database, table_prefix

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


class CuttableProxy:
    """A TCP proxy to PostgreSQL on the running event loop; ``cut`` drops everything."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.listen_port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[Any]] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.listen_port, reuse_address=True
        )
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """The database 'stops': new connections refused, live ones aborted."""
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)
        self._writers += [writer, upstream_writer]
        for pipe in (self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer)):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


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
            await until(lambda: worker.metrics.processed >= 60, 30, "the worker to get going")
            await proxy.cut()
            retries = worker.metrics.database_retries
            await asyncio.sleep(1.0)  # the outage lasts a second
            assert not task.done(), "the worker gave up during the outage"
            assert worker.metrics.database_retries >= retries + 3
            outage_seen.append(worker.metrics.outage)
            assert not broker.dead_letters  # an outage is never the message's fault
            await proxy.open()  # the database is back
            await until(
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
