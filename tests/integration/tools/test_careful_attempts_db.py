"""Careful mode's attempt statements on PostgreSQL and MariaDB (each dialect's own SQL)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, ClassVar

import pytest
from sqlalchemy import insert
from sqlalchemy.orm import Session

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy
from mqdedup.consumers.memory import run_until_idle_restarting
from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import SimulatedCrash
from tests.integration.tools.conftest import Database

pytestmark = pytest.mark.integration


def test_attempts_are_counted_before_running_and_stop_at_the_limit(database: Database) -> None:
    store = DedupStore(database.prefix)

    def start() -> tuple[int, str | None, bool]:
        with Session(database.engine) as session, session.begin():
            return store.start_attempt(session, "c", "m1", WORKER_DIED, 3)

    assert start() == (1, WORKER_DIED, True)
    with Session(database.engine) as session, session.begin():
        store.finish_attempt(session, "c", "m1", "ValueError: bad amount")
    assert start() == (2, WORKER_DIED, True)
    with Session(database.engine) as session, session.begin():
        store.undo_attempt(session, "c", "m1")  # its handler never ran
    assert start() == (2, WORKER_DIED, True)
    assert start() == (3, WORKER_DIED, True)
    # The limit is reached: nothing is written, the stored state comes back.
    assert start() == (3, WORKER_DIED, False)
    with Session(database.engine) as session, session.begin():
        store.finish_attempt(session, "c", "m1", "ValueError: bad amount")
    assert start() == (3, "ValueError: bad amount", False)
    with Session(database.engine) as session, session.begin():
        assert store.processed(session, "c", ["m1"]) == {}


def test_a_message_that_kills_its_worker_is_dead_lettered_alone(database: Database) -> None:
    orders = database.business.orders

    class Killer(Consumer):
        name = "careful-orders"
        table_prefix = database.prefix
        batch_size = 20
        poll_timeout = 0.05
        retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
        runs: ClassVar[Counter[str]] = Counter()

        def handle(self, message: Message, ctx: Context) -> Any:
            Killer.runs[str(message.id)] += 1
            if message.id == "m-10":
                raise SimulatedCrash("the handler killed its process")
            ctx.session.execute(insert(orders).values(message_id=message.id, order_id="x"))
            return {"ok": True}

    broker = InMemoryBroker()
    for number in range(60):
        broker.publish("orders", json.dumps({"n": number}), message_id=f"m-{number}")

    run = run_until_idle_restarting(Killer(), broker, "orders", database.engine)

    assert run.crashes == Killer.runs["m-10"] == 3  # max_attempts + the uncounted first
    dead = broker.dead_letters["orders"]
    assert [(d.message.header("message-id"), d.record.reason) for d in dead] == [
        ("m-10", WORKER_DIED)
    ]
    counts = database.business.order_counts(database.engine)
    assert len(counts) == 59 and set(counts.values()) == {1}
