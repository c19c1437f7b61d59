"""Steps sized for their pool (issues 39 and 40), on the shared PostgreSQL.

* A consumer declaring ``uses_steps = True`` is refused at start, in one line, on an
  engine whose pool cannot give a second connection while the message's transaction
  holds the first; with one connection more it starts.
* Undeclared, the message whose step waited for that connection is dead-lettered with a
  reason saying how to size the pool and that the declaration refuses it at start.
* A stop signal (SIGTERM) while a step waits in the pool's checkout (``pool_timeout``
  60 s) ends the wait at once: the message goes back unsettled (not dead-lettered, not
  acked, the external call not made) and is processed once later.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
from sqlalchemy import insert, select

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy
from mqdedup.consumers.worker import Worker
from mqdedup.db import create_engine
from mqdedup.errors import ConfigurationError
from mqdedup.stopping import StopToken, graceful_signals
from tests.services import TestDatabase, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration

QUEUE = "charges"
FAST = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05)


def charging(prefix: str, calls: list[str], **attributes: Any) -> Consumer:
    """A consumer writing the order, then charging through ``ctx.step``."""

    def handle(self: Consumer, message: Message, ctx: Context) -> Any:
        ctx.session.execute(insert(orders_table(prefix)).values(message_id=message.id, body="x"))
        if message.id == "m-0":  # no step
            return None
        return ctx.step("charge", lambda key: calls.append(key) or "charged")

    namespace = {
        "name": "charging",
        "table_prefix": prefix,
        "batch_size": 5,
        "poll_timeout": 0.02,
        "retry_policy": FAST,
        "handle": handle,
        **attributes,
    }
    return type("Charging", (Consumer,), namespace)()


def publish(broker: InMemoryBroker, ids: list[str]) -> None:
    for message_id in ids:
        broker.publish(QUEUE, json.dumps({"id": message_id}), message_id=message_id)


def order_ids(engine: Any, prefix: str) -> list[str]:
    table = orders_table(prefix)
    with engine.connect() as connection:
        return sorted(connection.execute(select(table.c.message_id)).scalars())


def test_a_consumer_declaring_steps_is_refused_at_start_on_a_pool_of_one(db: TestDatabase) -> None:
    broker = InMemoryBroker()
    publish(broker, ["m-1"])
    small = create_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=5)
    enough = create_engine(db.url, pool_size=1, max_overflow=1, pool_timeout=5)
    calls: list[str] = []
    try:
        with pytest.raises(ConfigurationError) as refused:
            Worker(charging(db.prefix, calls, uses_steps=True), broker.transport(QUEUE), small)
        line = str(refused.value)
        assert "\n" not in line
        assert line.startswith("Charging declares uses_steps = True, but the pool of ")
        assert "too small by 1" in line and "pool_size + max_overflow >= 2" in line
        assert ":***@" in line  # the URL is masked
        Worker(charging(db.prefix, calls, uses_steps=True), broker.transport(QUEUE), enough)
    finally:
        small.dispose()
        enough.dispose()
    assert calls == [] and order_ids(db.engine, db.prefix) == []
    assert broker.pending(QUEUE) == 1  # nothing was taken


def test_uses_steps_must_be_a_bool(db: TestDatabase) -> None:
    with pytest.raises(ConfigurationError, match=r"Charging.uses_steps must be True or False"):
        charging(db.prefix, [], uses_steps="yes").validate()


def test_an_undeclared_step_on_a_pool_of_one_names_the_declaration(db: TestDatabase) -> None:
    engine = create_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=0.3)
    broker = InMemoryBroker()
    publish(broker, ["m-1"])
    calls: list[str] = []
    try:
        Worker(charging(db.prefix, calls), broker.transport(QUEUE), engine).run(until_idle=True)
    finally:
        engine.dispose()
    letters = {str(d.message.id): d.record.reason for d in broker.dead_letters.get(QUEUE, [])}
    assert set(letters) == {"m-1"}
    assert "too small by 1" in letters["m-1"]
    assert "declare uses_steps = True on the consumer" in letters["m-1"]
    assert calls == [] and order_ids(db.engine, db.prefix) == []


def _waiting_in_a_step(thread_id: int) -> bool:
    """The thread is inside a step's start, waiting on a lock (the pool's checkout)."""
    frame = sys._current_frames().get(thread_id)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "_in_own_transaction" in names and "wait" in names


@pytest.mark.parametrize("isolation", ["auto", "transaction"])
def test_sigterm_ends_a_step_waiting_for_the_pools_checkout(
    db: TestDatabase, isolation: str
) -> None:
    """m-0 (no step) runs before m-1, whose step waits: in one transaction (auto) both
    go back; one transaction per message settles m-0, committed before the stop."""
    engine = create_engine(db.url, pool_size=1, max_overflow=0, pool_timeout=60)
    broker = InMemoryBroker()
    publish(broker, ["m-0", "m-1"])
    calls: list[str] = []
    consumer = charging(db.prefix, calls, failure_isolation=isolation)
    main = threading.get_ident()
    signalled: list[float] = []

    def terminate_once_waiting() -> None:
        wait_for(lambda: _waiting_in_a_step(main), 30, "the step waiting for the pool")
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    stop = StopToken()
    signaller = threading.Thread(target=terminate_once_waiting, daemon=True)
    started = time.monotonic()
    try:
        with graceful_signals(stop):
            signaller.start()
            worker = Worker(consumer, broker.transport(QUEUE), engine, stop=stop)
            worker.run()
        took = time.monotonic() - started
        after_signal = time.monotonic() - signalled[0]
    finally:
        signaller.join(timeout=60)
        engine.dispose()
    assert stop.requested
    assert took < 30, took  # the pool's timeout is 60 s
    print(f"\n[SIGTERM during a step's pool checkout] stopped {after_signal:.2f}s after it")
    committed = ["m-0"] if isolation == "transaction" else []
    assert calls == [] and order_ids(db.engine, db.prefix) == committed
    assert not broker.dead_letters.get(QUEUE)
    assert broker.pending(QUEUE) == 2 - len(committed)  # given back, not acked
    assert worker.metrics.failures == 0 and worker.metrics.dead_lettered == 0

    again = create_engine(db.url)  # two connections: the redelivery is processed once
    try:
        Worker(consumer, broker.transport(QUEUE), again).run(until_idle=True)
    finally:
        again.dispose()
    assert order_ids(db.engine, db.prefix) == ["m-0", "m-1"]
    assert len(calls) == 1 and not broker.dead_letters.get(QUEUE)
    assert broker.pending(QUEUE) == 0
