"""``ctx.step`` and ``ctx.idempotency_key`` on real PostgreSQL (in-memory broker).

A handler charges a fake gateway through ``ctx.step`` and then fails for some messages
(a retry), in every failure-isolation mode and in an async consumer: each message's
gateway call happens once, its retry (and, in ``rerun`` mode, its batch-mates' reruns)
get the recorded result. A crash between the call and its record makes the rerun call
again with the same key (the window the gateway's own deduplication covers). Steps are
purged with their claims. The real-process version (``mqdedup worker``, kill -9, a real
HTTP gateway) is ``tests/acceptance/test_cli_steps_killer.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select

from mqdedup import (
    AsyncConsumer,
    AsyncContext,
    Consumer,
    Context,
    InMemoryBroker,
    Message,
    RetryPolicy,
    run_until_idle,
)
from mqdedup.consumers.memory import run_until_idle_restarting
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.steps import idempotency_key
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import SimulatedCrash
from tests.integration.rabbitmq.support import order_counts
from tests.services import TestDatabase
from tests.support import orders_table

pytestmark = pytest.mark.integration

QUEUE = "charges"
COUNT = 60
FAIL_AFTER_STEP = {"m-7", "m-21", "m-40"}


class Gateway:
    """A payment API stand-in: counts every call, charges once per idempotency key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()  # message id -> calls
        self.keys: dict[str, set[str]] = {}  # message id -> keys used
        self.charges: dict[str, str] = {}  # key -> charge id

    def charge(self, key: str, message_id: str) -> dict[str, Any]:
        with self.lock:
            self.calls[message_id] += 1
            self.keys.setdefault(message_id, set()).add(key)
            charge = self.charges.setdefault(key, f"ch-{len(self.charges)}")
        return {"charge": charge, "amount": 10}


def publish(broker: InMemoryBroker) -> list[str]:
    ids = [f"m-{n}" for n in range(COUNT)]
    for message_id in ids:
        broker.publish(QUEUE, json.dumps({"amount": 10}), message_id=message_id)
    assert broker.inject_duplicates(QUEUE, 0.3) > 5
    return ids


def step_rows(db: TestDatabase) -> dict[str, tuple[str, int]]:
    table = schema(db.prefix).steps
    with db.engine.connect() as connection:
        rows = connection.execute(select(table.c.message_id, table.c.state, table.c.attempts))
        return {row.message_id: (row.state, row.attempts) for row in rows}


def charging_consumer(db: TestDatabase, gateway: Gateway, isolation: str) -> Consumer:
    orders = orders_table(db.prefix)
    failed: set[str] = set()

    class Charging(Consumer):
        name = "charging"
        table_prefix = db.prefix
        batch_size = 20
        poll_timeout = 0.02
        failure_isolation = isolation  # type: ignore[assignment]
        retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)

        def handle(self, message: Message, ctx: Context) -> Any:
            assert message.id is not None
            charged = ctx.step("charge", lambda key: gateway.charge(key, str(message.id)))
            assert ctx.idempotency_key("charge") == idempotency_key(
                "charging", message.id, "charge"
            )
            ctx.session.execute(
                insert(orders).values(message_id=message.id, body=charged["charge"])
            )
            if message.id in FAIL_AFTER_STEP and message.id not in failed:
                failed.add(message.id)
                raise RuntimeError("the handler fails once after its step")
            return charged

    return Charging()


@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_each_message_is_charged_once_in_every_failure_isolation_mode(
    db: TestDatabase, isolation: str
) -> None:
    broker, gateway = InMemoryBroker(seed=5), Gateway()
    ids = publish(broker)
    metrics = run_until_idle(
        charging_consumer(db, gateway, isolation), broker.transport(QUEUE), db.engine
    )

    assert metrics.failures == len(FAIL_AFTER_STEP)  # each failed once, then succeeded
    assert gateway.calls == dict.fromkeys(ids, 1)  # the retries read the record
    assert all(len(keys) == 1 for keys in gateway.keys.values())
    assert order_counts(db.engine, orders_table(db.prefix)) == dict.fromkeys(ids, 1)
    assert step_rows(db) == dict.fromkeys(ids, ("done", 1))
    assert broker.dead_letters.get(QUEUE, []) == []


def test_a_crash_between_the_call_and_its_record_calls_again_with_the_same_key(
    db: TestDatabase,
) -> None:
    """The documented window: the rerun calls again, the key makes it one charge."""
    broker, gateway = InMemoryBroker(), Gateway()
    ids = publish(broker)
    orders = orders_table(db.prefix)
    crashed: list[str] = []

    def charge_then_crash(key: str, message_id: str) -> dict[str, Any]:
        charged = gateway.charge(key, message_id)
        if message_id == "m-3" and not crashed:
            crashed.append(message_id)
            raise SimulatedCrash("the process dies after the call, before its record")
        return charged

    class Charging(Consumer):
        name = "charging"
        table_prefix = db.prefix
        batch_size = 10
        poll_timeout = 0.02

        def handle(self, message: Message, ctx: Context) -> Any:
            charged = ctx.step("charge", lambda key: charge_then_crash(key, str(message.id)))
            ctx.session.execute(insert(orders).values(message_id=message.id, body="x"))
            return charged

    run = run_until_idle_restarting(Charging(), broker, QUEUE, db.engine)

    assert run.crashes == 1
    assert gateway.calls["m-3"] == 2 and len(gateway.keys["m-3"]) == 1  # same key twice
    assert len(gateway.charges) == len(ids)  # one charge per message
    assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
    assert step_rows(db)["m-3"] == ("done", 2)


def test_an_async_consumer_awaits_its_steps_once_per_message(db: TestDatabase) -> None:
    broker, gateway = InMemoryBroker(seed=9), Gateway()
    ids = publish(broker)
    orders = orders_table(db.prefix)
    failed: set[str] = set()

    class AsyncCharging(AsyncConsumer):
        name = "async-charging"
        table_prefix = db.prefix
        batch_size = 20
        poll_timeout = 0.02
        retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)

        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            async def call(key: str) -> dict[str, Any]:
                await asyncio.sleep(0)
                return gateway.charge(key, str(message.id))

            charged = await ctx.step("charge", call)
            await ctx.session.execute(insert(orders).values(message_id=message.id, body="a"))
            if message.id in FAIL_AFTER_STEP and message.id not in failed:
                failed.add(str(message.id))
                raise RuntimeError("fails once after its step")
            return charged

    run_async_until_idle(db, AsyncCharging(), broker)

    assert gateway.calls == dict.fromkeys(ids, 1)
    assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
    assert step_rows(db) == dict.fromkeys(ids, ("done", 1))


def run_async_until_idle(db: TestDatabase, consumer: AsyncConsumer, broker: InMemoryBroker) -> None:
    """Run ``consumer`` on an AsyncEngine of the test database until the queue is idle."""

    async def scenario() -> None:
        engine = create_async_engine(db.url)
        try:
            await Worker(consumer, broker.transport(QUEUE), engine).run_async(until_idle=True)
        finally:
            await engine.dispose()

    asyncio.run(scenario())


def test_steps_are_purged_with_their_claims(db: TestDatabase) -> None:
    broker, gateway = InMemoryBroker(), Gateway()
    publish(broker)
    run_until_idle(charging_consumer(db, gateway, "auto"), broker.transport(QUEUE), db.engine)
    assert len(step_rows(db)) == COUNT

    deleted = DedupStore(db.prefix).purge(db.engine, timedelta(0))

    assert deleted == COUNT
    with db.engine.connect() as connection:
        left = connection.execute(select(func.count()).select_from(schema(db.prefix).steps))
        assert left.scalar() == 0


def test_an_async_batch_handler_names_the_message_of_each_step(db: TestDatabase) -> None:
    broker, gateway = InMemoryBroker(seed=4), Gateway()
    ids = publish(broker)

    class AsyncBatchCharging(AsyncConsumer):
        name = "async-batch-charging"
        table_prefix = db.prefix
        batch_size = 25
        poll_timeout = 0.02

        async def handle_batch(self, messages: Sequence[Message], ctx: AsyncContext) -> Any:
            for message in messages:
                await ctx.step(
                    "charge", lambda key, m=message: gateway.charge(key, str(m.id)), message
                )
            return None

    run_async_until_idle(db, AsyncBatchCharging(), broker)

    assert gateway.calls == dict.fromkeys(ids, 1)
    assert step_rows(db) == dict.fromkeys(ids, ("done", 1))
