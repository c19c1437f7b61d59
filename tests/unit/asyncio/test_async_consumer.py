"""Async consumers on the one pipeline: SQLite through aiosqlite, the in-memory broker.

``async def handle`` with ``ctx.session`` an ``AsyncSession`` and ``await
ctx.outbox.publish``; the same Worker and Processor as synchronous consumers, running
on an event loop inside the bridge. Each test asserts rows, outbox rows, dead letters
and what the broker settled, and that the event loop kept running meanwhile.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, String, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mqdedup import AsyncConsumer, AsyncContext, Consumer, Context, InMemoryBroker, Message
from mqdedup.bridge import NotInBridgeError
from mqdedup.consumers.base import RetryPolicy
from mqdedup.consumers.context import AsyncBatchContext
from mqdedup.consumers.memory import MemoryTransport, run_until_idle_restarting
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.consumers.replay import ReplayReport, ReplayRun
from mqdedup.consumers.transport import Transport
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.engine import session_factory
from mqdedup.db.schema import schema
from mqdedup.errors import ConfigurationError, SimulatedCrash
from mqdedup.outbox.writer import OutboxWriter, outgoing_message_id
from mqdedup.stopping import StopToken
from mqdedup.testing import ConsumerHarness, EffectivelyOnceError, assert_effectively_once
from tests.support import orders
from tests.unit.test_replay_run import ListRange

QUEUE = "async-orders"


class Ticker:
    """A task on the worker's event loop: it ticks only while the loop is free."""

    def __init__(self, interval: float = 0.01) -> None:
        self.ticks = 0
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.ticks += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()


class AsyncOrders(AsyncConsumer):
    """One order row and one outgoing event per message; the order number as result."""

    name = "async-orders"
    poll_timeout = 0.05
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.2, max_backoff=0.4)
    fail_ids: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.duplicates: list[tuple[str, Any]] = []
        self.committed: list[str] = []
        self.calls: dict[str, int] = {}
        self.committed_at = 0.0

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        assert isinstance(ctx.session, AsyncSession)
        self.calls[str(message.id)] = self.calls.get(str(message.id), 0) + 1
        order = message.json()["order"]
        await ctx.session.execute(insert(orders).values(message_id=message.id, amount=order))
        if message.id in self.fail_ids:
            raise ValueError(f"cannot ship order {order}")
        await ctx.outbox.publish({"shipped": order}, topic="shipments", key=str(order))
        return {"order": order}

    async def on_duplicate(self, message: Message, stored_result: Any) -> None:
        await asyncio.sleep(0)
        self.duplicates.append((str(message.id), stored_result))

    async def after_commit(self, messages: Sequence[Message]) -> None:
        await asyncio.sleep(0)
        self.committed.extend(str(m.id) for m in messages)
        self.committed_at = time.monotonic()


def order_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(orders.c.message_id, func.count()).group_by(orders.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


def outbox_ids(engine: Engine) -> set[str]:
    table = schema().outbox
    with engine.connect() as connection:
        return set(connection.execute(select(table.c.message_id)).scalars())


async def work(
    consumer: Consumer, transport: Transport[Any], engine: Engine, ticker: Ticker
) -> Metrics:
    """Run ``consumer`` until idle on this loop, with an aiosqlite engine; tick meanwhile."""
    async_engine = create_async_engine(engine)
    ticker.start()
    try:
        return await Worker(consumer, transport, async_engine).run_async(until_idle=True)
    finally:
        ticker.stop()
        await async_engine.dispose()


def publish_orders(broker: InMemoryBroker, numbers: range) -> list[str]:
    ids = [f"order-{n}" for n in numbers]
    for n, message_id in zip(numbers, ids, strict=True):
        broker.publish(QUEUE, f'{{"order": {n}}}', message_id=message_id)
    return ids


def test_async_handler_writes_once_with_outbox_results_and_hooks(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker(seed=7)
    ids = publish_orders(broker, range(20))
    broker.inject_duplicates(QUEUE, 1.0)  # in-batch repeats
    consumer = AsyncOrders()
    ticker = Ticker()

    asyncio.run(work(consumer, broker.transport(QUEUE), sqlite_engine, ticker))
    publish_orders(broker, range(5))  # redelivered later: duplicates found by the claim
    metrics = asyncio.run(work(consumer, broker.transport(QUEUE), sqlite_engine, Ticker()))

    assert order_counts(sqlite_engine) == dict.fromkeys(ids, 1)
    assert outbox_ids(sqlite_engine) == {outgoing_message_id(consumer.name, i, 0) for i in ids}
    assert sorted(consumer.committed) == sorted(ids)  # async after_commit, once each
    # async on_duplicate: the first delivery's stored result, also across runs
    assert len(consumer.duplicates) == 25
    later = {mid: stored for mid, stored in consumer.duplicates[-5:]}
    assert later == {f"order-{n}": {"order": n} for n in range(5)}
    assert metrics.duplicates == 5 and metrics.processed == 0
    assert broker.settled_count[QUEUE] == 45 and broker.pending(QUEUE) == 0
    assert not broker.dead_letters


def test_a_waiting_fetch_leaves_the_event_loop_free(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    consumer = AsyncOrders()
    consumer.poll_timeout = 1.0
    ticker = Ticker()

    async def publish_later() -> float:
        await asyncio.sleep(0.1)  # runs only if the worker's fetch does not block the loop
        publish_orders(broker, range(1))
        return time.monotonic()

    async def scenario() -> tuple[Metrics, float]:
        publisher = asyncio.create_task(publish_later())
        metrics = await work(consumer, broker.transport(QUEUE), sqlite_engine, ticker)
        return metrics, await publisher

    metrics, published_at = asyncio.run(scenario())

    assert metrics.processed == 1 and consumer.committed == ["order-0"]
    assert consumer.committed_at - published_at < 0.5  # the fetch woke up at once
    assert ticker.ticks >= 30  # ~1.1 s of waiting in fetch, on the loop


def test_failing_handler_retried_then_dead_lettered_alone_loop_keeps_running(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    ids = publish_orders(broker, range(10))
    consumer = AsyncOrders()
    consumer.fail_ids = frozenset({"order-3"})
    ticker = Ticker()

    metrics = asyncio.run(work(consumer, broker.transport(QUEUE), sqlite_engine, ticker))

    assert order_counts(sqlite_engine) == {i: 1 for i in ids if i != "order-3"}
    assert consumer.calls["order-3"] == 3  # max_attempts
    (letter,) = broker.dead_letters[QUEUE]
    assert letter.message.headers["message-id"] == "order-3"
    assert "ValueError: cannot ship order 3" in letter.record.reason
    assert metrics.dead_lettered == 1 and metrics.retries == 2
    assert broker.settled_count[QUEUE] == 10
    # Two backoffs (>= 0.18 s + 0.36 s with jitter) waited on the loop: it kept ticking.
    assert ticker.ticks >= 20, ticker.ticks


class SessionAbuser(AsyncConsumer):
    """Writes, then tries to end the pipeline's transaction (message id = the method)."""

    name = "abuser"
    poll_timeout = 0.05
    retry_policy = RetryPolicy(max_attempts=1)

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        await ctx.session.execute(insert(orders).values(message_id=message.id))
        method = str(message.id)
        if method == "begin_nested":  # a savepoint of the handler's own is allowed
            async with ctx.session.begin_nested():
                await ctx.session.execute(insert(orders).values(message_id="nested"))
        elif method == "begin":
            await ctx.session.begin()
        else:
            await getattr(ctx.session, method)()
        return None


def test_guarded_async_session_refuses_to_end_the_transaction(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    for method in ("commit", "rollback", "close", "begin", "begin_nested"):
        broker.publish(QUEUE, b"{}", message_id=method)

    asyncio.run(work(SessionAbuser(), broker.transport(QUEUE), sqlite_engine, Ticker()))

    assert order_counts(sqlite_engine) == {"begin_nested": 1, "nested": 1}
    refused = {
        letter.message.headers["message-id"]: letter.record.reason
        for letter in broker.dead_letters[QUEUE]
    }
    assert set(refused) == {"commit", "rollback", "close", "begin"}
    for method, reason in refused.items():
        assert f"ctx.session.{method}() is not allowed" in reason
    assert broker.settled_count[QUEUE] == 5


class BulkAsyncOrders(AsyncConsumer):
    name = "bulk-async-orders"
    poll_timeout = 0.05
    batch_size = 7

    async def handle_batch(
        self, messages: Sequence[Message], ctx: AsyncBatchContext
    ) -> dict[str, Any]:
        rows = [{"message_id": m.id, "amount": m.json()["order"]} for m in messages]
        await ctx.session.execute(insert(orders), rows)
        return {str(m.id): {"bulk": True} for m in messages}


def test_harness_kit_runs_async_consumers_effectively_once(sqlite_engine: Engine) -> None:
    class SmallBatches(AsyncOrders):
        batch_size = 5

    class SmallBulkBatches(BulkAsyncOrders):
        batch_size = 5

    for consumer_class, queue in ((SmallBatches, "kit"), (SmallBulkBatches, "kit-bulk")):
        harness = ConsumerHarness(consumer_class, sqlite_engine, queue=queue)
        for n in range(30):
            harness.publish({"order": n}, message_id=f"{queue}-{n}")
        harness.deliver_each_twice()
        harness.run_crashing_after_commit(times=3)
        harness.run_crashing_mid_batch(after_messages=3)
        harness.run()
        assert harness.crashes == 4
        counts = {k: v for k, v in order_counts(sqlite_engine).items() if k in harness.ids}
        assert_effectively_once(counts, harness.ids)
        assert harness.broker.pending(queue) == 0

    class WithoutDedup(SmallBulkBatches):  # the control: the same faults, no claims
        name = "no-dedup"
        deduplicate = False

    harness = ConsumerHarness(WithoutDedup, sqlite_engine, queue="control")
    for n in range(30):
        harness.publish({"order": n}, message_id=f"control-{n}")
    harness.deliver_each_twice()
    harness.run_crashing_after_commit(times=3)
    harness.run()
    counts = {k: v for k, v in order_counts(sqlite_engine).items() if k in harness.ids}
    with pytest.raises(EffectivelyOnceError):
        assert_effectively_once(counts, harness.ids)


class Gated(AsyncConsumer):
    """The first handler call waits for ``gate``: a batch in flight to cancel."""

    name = "gated"
    batch_size = 5
    poll_timeout = 0.05

    def __init__(self, transport: MemoryTransport) -> None:
        self.transport = transport
        self.started = asyncio.Event()
        self.gate = asyncio.Event()

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> MemoryTransport:
        return self.transport

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        self.started.set()
        await self.gate.wait()
        await ctx.session.execute(insert(orders).values(message_id=message.id))
        return None


def test_cancelling_run_async_finishes_the_batch_in_flight(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    publish_orders(broker, range(20))
    transport = broker.transport(QUEUE)

    async def scenario() -> None:
        engine = create_async_engine(sqlite_engine)
        consumer = Gated(transport)
        task = asyncio.create_task(consumer.run_async(engine))
        await asyncio.wait_for(consumer.started.wait(), 10)
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()  # draining: the batch in flight is finished first
        consumer.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        await engine.dispose()

    asyncio.run(scenario())

    assert len(order_counts(sqlite_engine)) == 5  # the batch in flight committed ...
    assert broker.settled_count[QUEUE] == 5  # ... and was settled
    assert transport.closed and broker.pending(QUEUE) == 15  # nothing more was taken


def test_a_second_cancel_stops_at_once_settling_nothing(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    publish_orders(broker, range(20))
    transport = broker.transport(QUEUE)

    async def scenario() -> None:
        engine = create_async_engine(sqlite_engine)
        consumer = Gated(transport)
        task = asyncio.create_task(consumer.run_async(engine))
        await asyncio.wait_for(consumer.started.wait(), 10)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # impatient: the handler is interrupted, its transaction rolled back
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        await engine.dispose()

    asyncio.run(scenario())

    assert order_counts(sqlite_engine) == {}
    assert broker.settled_count.get(QUEUE, 0) == 0
    assert transport.closed and broker.pending(QUEUE) == 20  # all back, for the next run


class SyncWithAsyncHandler(Consumer):
    async def handle(self, message: Message, ctx: Context) -> Any:  # type: ignore[override]
        return None


class AsyncWithSyncHandler(AsyncConsumer):
    def handle(self, message: Message, ctx: AsyncContext) -> Any:  # type: ignore[override]
        return None


def test_mixed_up_handler_styles_and_sessions_get_clear_answers(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"subclass mqdedup\.AsyncConsumer"):
        SyncWithAsyncHandler().validate()
    with pytest.raises(ConfigurationError, match="must be `async def` in an AsyncConsumer"):
        AsyncWithSyncHandler().validate()

    async def misuse() -> None:
        engine = create_async_engine(f"sqlite:///{tmp_path / 'x.db'}")
        async with AsyncSession(engine) as session:
            with pytest.raises(TypeError, match=r"use `await AsyncOutboxWriter\(session\)"):
                OutboxWriter(session)  # type: ignore[arg-type]
        with pytest.raises(NotInBridgeError, match=r"await consumer\.run_async"):
            AsyncOrders().run(engine)  # a blocking run inside a running loop
        await engine.dispose()

    asyncio.run(misuse())
    assert create_async_engine("postgresql://u:pw@db/shop").dialect.is_async  # psycopg 3
    if importlib.util.find_spec("aiomysql") is None:
        with pytest.raises(ConfigurationError, match=r"needs the aiomysql driver.*pip install"):
            create_async_engine("mysql+pymysql://u:secret@db/shop")


def test_a_replay_runs_an_async_consumer_over_a_range(sqlite_engine: Engine) -> None:
    """``mqdedup replay``'s run: a synchronous range transport, the Worker bridged on an
    event loop of its own, the consumer's async handler on the replay's session."""
    messages = [
        Message(body=f'{{"order": {n}}}'.encode(), headers={"message-id": f"order-{n}"})
        for n in range(8)
    ]

    def replay(*, dry_run: bool = False) -> ReplayReport:
        transport = ListRange([*messages, messages[2]])
        run = ReplayRun(AsyncOrders(), session_factory(sqlite_engine), transport, dry_run=dry_run)
        report = run.run()
        assert transport.closed
        return report

    dry = replay(dry_run=True)
    assert (dry.new, dry.duplicates) == (8, 1) and order_counts(sqlite_engine) == {}
    first = replay()
    assert (first.new, first.duplicates, first.dead_lettered) == (8, 1, 0)
    assert order_counts(sqlite_engine) == {f"order-{n}": 1 for n in range(8)}
    again = replay()
    assert (again.new, again.duplicates) == (0, 9)
    assert outbox_ids(sqlite_engine) == {
        outgoing_message_id(AsyncOrders.name, f"order-{n}", 0) for n in range(8)
    }


def test_a_sync_consumer_runs_bridged_on_an_async_engine(sqlite_engine: Engine) -> None:
    """A plain consumer given an ``AsyncEngine``: the Worker runs it inside the bridge."""
    from tests.support import OrderConsumer

    broker = InMemoryBroker()
    for n in range(5):
        broker.publish(QUEUE, f'{{"order": {n}}}', message_id=f"order-{n}")

    async def scenario() -> Metrics:
        engine = create_async_engine(sqlite_engine)
        try:
            return await Worker(OrderConsumer(), broker.transport(QUEUE), engine).run_async(
                until_idle=True
            )
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()).processed == 5
    assert order_counts(sqlite_engine) == {f"order-{n}": 1 for n in range(5)}


def test_the_processor_refuses_an_async_consumer_outside_the_bridge(
    sqlite_engine: Engine,
) -> None:
    from mqdedup.consumers.processor import Processor

    broker = InMemoryBroker()
    broker.publish(QUEUE, b'{"order": 1}', message_id="order-1")
    transport = broker.transport(QUEUE)
    processor = Processor(AsyncOrders(), session_factory(sqlite_engine), transport)
    with pytest.raises(NotInBridgeError, match=r"is an AsyncConsumer"):
        processor.process(transport.fetch(10, 0.1))
    assert not broker.dead_letters  # a programming error, never the message's fault


@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_every_failure_isolation_mode_fails_the_culprit_alone(
    sqlite_engine: Engine, isolation: str
) -> None:
    class Isolated(AsyncOrders):
        failure_isolation = isolation  # type: ignore[assignment]
        retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)
        fail_ids = frozenset({"order-4"})

    broker = InMemoryBroker()
    ids = publish_orders(broker, range(10))
    consumer = Isolated()

    asyncio.run(work(consumer, broker.transport(QUEUE), sqlite_engine, Ticker()))

    assert order_counts(sqlite_engine) == {i: 1 for i in ids if i != "order-4"}
    assert outbox_ids(sqlite_engine) == {
        outgoing_message_id(consumer.name, i, 0) for i in ids if i != "order-4"
    }
    assert [d.message.headers["message-id"] for d in broker.dead_letters[QUEUE]] == ["order-4"]
    assert broker.settled_count[QUEUE] == 10


WITHOUT_GREENLET = """
import sys, tempfile
sys.modules["greenlet"] = None  # "not installed": the asyncio extra is optional
from mqdedup import AsyncConsumer, ConfigurationError, InMemoryBroker, create_engine
from mqdedup import run_until_idle
from tests.support import OrderConsumer, order_counts, reset_database

engine = create_engine(f"sqlite:///{tempfile.mkdtemp()}/x.db")
reset_database(engine)
broker = InMemoryBroker()
broker.publish("q", '{"order": 1}', message_id="m1")
assert run_until_idle(OrderConsumer(), broker.transport("q"), engine).processed == 1
assert "sqlalchemy.ext.asyncio" not in sys.modules

class Orders(AsyncConsumer):
    async def handle(self, message, ctx): ...
    def create_transport(self, **_): return broker.transport("q")

try:
    Orders().run(engine)
except ConfigurationError as error:
    print(error)
"""


def test_without_the_asyncio_extra_sync_consumers_work_and_async_ones_say_why() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_GREENLET],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[3],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (
        "async consumers need greenlet, which is not installed: pip install 'mqdedup[asyncio]'"
    )


class OrmBase(DeclarativeBase):
    pass


class Shipment(OrmBase):
    __tablename__ = "async_shipments"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(64), unique=True)


class OrmShipments(AsyncConsumer):
    """The AsyncSession API a handler uses: ORM add/flush/get, scalar, connection, run_sync."""

    name = "orm-shipments"
    poll_timeout = 0.05

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        shipment = Shipment(message_id=str(message.id))
        ctx.session.add(shipment)
        await ctx.session.flush()
        assert (await ctx.session.get(Shipment, shipment.id)) is shipment
        count = await ctx.session.scalar(select(func.count()).select_from(Shipment))
        connection = await ctx.session.connection()
        assert (await connection.execute(text("SELECT 1"))).scalar() == 1
        written = await ctx.session.run_sync(
            lambda session: OutboxWriter(session).publish({"n": count}, topic="shipped")
        )
        return {"seen": count, "event": written}


def test_the_async_session_api_works_in_the_message_transaction(sqlite_engine: Engine) -> None:
    OrmBase.metadata.create_all(sqlite_engine)
    broker = InMemoryBroker()
    for n in range(3):
        broker.publish(QUEUE, b"{}", message_id=f"ship-{n}")

    metrics = asyncio.run(work(OrmShipments(), broker.transport(QUEUE), sqlite_engine, Ticker()))

    assert metrics.processed == 3 and not broker.dead_letters
    with sqlite_engine.connect() as connection:
        shipped = connection.execute(select(Shipment.message_id)).scalars().all()
    assert sorted(shipped) == ["ship-0", "ship-1", "ship-2"]
    assert len(outbox_ids(sqlite_engine)) == 3


class Killer(AsyncOrders):
    """``order-2``'s handler kills its worker (as ``os._exit`` would) every time."""

    name = "killer"
    batch_size = 4
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        if message.id == "order-2":
            raise SimulatedCrash("the process died")
        return await super().handle(message, ctx)


def test_a_message_that_kills_its_async_worker_is_dead_lettered_in_careful_mode(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    ids = publish_orders(broker, range(8))

    run = run_until_idle_restarting(Killer(), broker, QUEUE, sqlite_engine)

    assert run.crashes == 3  # its first batch, then once per attempt in careful mode
    assert order_counts(sqlite_engine) == {i: 1 for i in ids if i != "order-2"}
    (letter,) = broker.dead_letters[QUEUE]
    assert letter.message.headers["message-id"] == "order-2"
    assert letter.record.reason.startswith(WORKER_DIED)
