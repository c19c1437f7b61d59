"""Careful mode on PostgreSQL and MariaDB (the attempt statements themselves are in the
claim-store contract suite, tests/contract/test_claim_store.py)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, ClassVar

import pytest
from sqlalchemy import insert

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy
from mqdedup.consumers.memory import run_until_idle_restarting
from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.errors import SimulatedCrash
from tests.integration.tools.conftest import Database

pytestmark = pytest.mark.integration


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
