"""A stop signal ends a step's wait for a connection in the event loop (issue 40), on the
shared PostgreSQL through an ``AsyncEngine`` (``postgresql+psycopg``, asyncio).

An ``AsyncConsumer`` whose ``await ctx.step(...)`` (or a synchronous consumer on the
``AsyncEngine`` whose ``ctx.step(...)``) waits in the async pool's checkout
(one connection, held by the message's transaction; ``pool_timeout`` 60 s): SIGTERM ends
the wait at once, though it happens in the event loop, which the signal handler does not
interrupt. The message goes back unsettled (not dead-lettered, not acked, the external
call not made) and is processed once by a later run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from sqlalchemy import insert, select

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
from mqdedup.db.async_engine import create_async_engine
from mqdedup.stopping import StopToken, graceful_signals
from tests.services import TestDatabase, wait_for, wait_for_on_loop
from tests.support import orders_table

pytestmark = pytest.mark.integration

QUEUE = "charges"


def charging(kind: str, prefix: str, calls: list[str], reached: list[str]) -> Any:
    """A consumer (``kind``: an ``AsyncConsumer``, or a synchronous one on the
    AsyncEngine) writing the order, then charging through its step (m-0 has none);
    ``reached`` gets the event loop it runs on and the messages that reached the step."""
    table = orders_table(prefix)
    attributes = {
        "name": f"{kind}-charging",
        "table_prefix": prefix,
        "batch_size": 5,
        "poll_timeout": 0.02,
        "retry_policy": RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05),
    }

    class AsyncCharging(AsyncConsumer):
        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            reached.append(asyncio.get_running_loop())
            await ctx.session.execute(insert(table).values(message_id=message.id, body="a"))
            if message.id == "m-0":
                return None

            async def charge(key: str) -> str:
                calls.append(key)
                return "charged"

            reached.append(message.id)
            return await ctx.step("charge", charge)

    class Charging(Consumer):
        def handle(self, message: Message, ctx: Context) -> Any:
            reached.append(asyncio.get_running_loop())
            ctx.session.execute(insert(table).values(message_id=message.id, body="s"))
            if message.id == "m-0":
                return None
            reached.append(message.id)
            return ctx.step("charge", lambda key: calls.append(key) or "charged")

    base = AsyncCharging if kind == "async" else Charging
    return type(base.__name__, (base,), attributes)()


def _awaits(awaitable: Any) -> list[str]:
    """The names of the coroutines ``awaitable`` awaits, down its chain (through the
    async generator of an ``async with`` on an ``asynccontextmanager``)."""
    names = []
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "ag_code", None)
        if code is None:
            break
        names.append(code.co_name)
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
        following = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
        generator = getattr(frame.f_locals.get("self"), "gen", None) if frame else None
        if generator is not None and hasattr(generator, "ag_await"):
            following = generator  # contextlib's __aenter__ awaits anext(self.gen)
        awaitable = following
    return names


async def _awaiting_a_wait_for() -> bool:
    """A task of the loop awaits a ``wait_for`` (SQLAlchemy's, on the async pool's queue)."""
    return _awaiting_a_wait_for_now()


def _waiting(reached: list[Any]) -> bool:
    """m-1 reached its step, which waits in the pool's checkout (with or without the fix)."""
    if "m-1" not in reached:
        return False
    probe: Coroutine[Any, Any, bool] = _awaiting_a_wait_for()
    return asyncio.run_coroutine_threadsafe(probe, reached[0]).result(timeout=10)


def order_ids(db: TestDatabase) -> list[str]:
    table = orders_table(db.prefix)
    with db.engine.connect() as connection:
        return sorted(connection.execute(select(table.c.message_id)).scalars())


@pytest.mark.parametrize(
    ("kind", "isolation"), [("async", "auto"), ("async", "transaction"), ("sync", "auto")]
)
def test_sigterm_ends_a_step_waiting_for_the_async_pools_checkout(
    db: TestDatabase, kind: str, isolation: str
) -> None:
    broker = InMemoryBroker()
    for message_id in ("m-0", "m-1"):
        broker.publish(QUEUE, json.dumps({"id": message_id}), message_id=message_id)
    calls: list[str] = []
    reached: list[Any] = []
    consumer = charging(kind, db.prefix, calls, reached)
    consumer.failure_isolation = isolation
    signalled: list[float] = []

    def terminate_once_waiting() -> None:
        wait_for(lambda: _waiting(reached), 30, "the async step waiting for the pool")
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    async def first_run(stop: StopToken) -> Worker:
        engine = create_async_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=60)
        try:
            worker = Worker(consumer, broker.transport(QUEUE), engine, stop=stop)
            await worker.run_async()
            return worker
        finally:
            await engine.dispose()

    stop = StopToken()
    signaller = threading.Thread(target=terminate_once_waiting, daemon=True)
    started = time.monotonic()
    try:
        with graceful_signals(stop):
            signaller.start()
            worker = asyncio.run(first_run(stop))
        took = time.monotonic() - started
        after_signal = time.monotonic() - signalled[0]
    finally:
        signaller.join(timeout=60)
    assert stop.requested
    assert took < 30, took  # the pool's timeout is 60 s
    print(f"\n[SIGTERM during an async step's checkout] stopped {after_signal:.2f}s after it")
    committed = ["m-0"] if isolation == "transaction" else []
    assert calls == [] and order_ids(db) == committed
    assert not broker.dead_letters.get(QUEUE)
    assert broker.pending(QUEUE) == 2 - len(committed)  # given back, not acked
    assert worker.metrics.failures == 0 and worker.metrics.dead_lettered == 0

    async def second_run() -> None:  # two connections: the redelivery is processed once
        engine = create_async_engine(db.url)
        try:
            await Worker(consumer, broker.transport(QUEUE), engine).run_async(until_idle=True)
        finally:
            await engine.dispose()

    asyncio.run(second_run())
    assert order_ids(db) == ["m-0", "m-1"]
    assert len(calls) == 1 and not broker.dead_letters.get(QUEUE)
    assert broker.pending(QUEUE) == 0


def test_cancelling_run_async_ends_an_async_step_waiting_for_the_pools_checkout(
    db: TestDatabase,
) -> None:
    """Cancelling the task running ``Worker.run_async`` (a graceful stop) ends the wait
    too: the batch goes back unsettled."""
    broker = InMemoryBroker()
    for message_id in ("m-0", "m-1"):
        broker.publish(QUEUE, json.dumps({"id": message_id}), message_id=message_id)
    calls: list[str] = []
    reached: list[Any] = []
    consumer = charging("async", db.prefix, calls, reached)
    stop = StopToken()

    async def scenario() -> float:
        engine = create_async_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=60)
        worker = Worker(consumer, broker.transport(QUEUE), engine, stop=stop)
        task = asyncio.ensure_future(worker.run_async())
        try:
            await wait_for_on_loop(
                lambda: task.done() or ("m-1" in reached and _awaiting_a_wait_for_now()),
                30,
                "the async step waiting for the pool",
            )
            assert not task.done()
            cancelled = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return time.monotonic() - cancelled
        finally:
            await engine.dispose()

    took = asyncio.run(scenario())
    assert stop.requested and took < 30, took  # the pool's timeout is 60 s
    assert calls == [] and order_ids(db) == []
    assert not broker.dead_letters.get(QUEUE) and broker.pending(QUEUE) == 2


def _awaiting_a_wait_for_now() -> bool:
    """:func:`_awaiting_a_wait_for`, called on the loop itself."""
    return any("wait_for" in _awaits(task.get_coro()) for task in asyncio.all_tasks())
