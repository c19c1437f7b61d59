"""User callbacks never crash a worker nor change a message's fate (SQLite, in memory).

``on_duplicate`` and ``after_commit`` raising, for duplicates found by the claim and
for copies inside one batch; a raising ``message_id_strategy`` in a run and in a
replay's dry run. The same on real PostgreSQL: ``tests/integration/test_step_records.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Engine

from mqdedup import Consumer, Context, InMemoryBroker, Message, run_until_idle
from mqdedup.consumers.replay import ReplayReport, ReplayTally
from mqdedup.consumers.transport import Delivery
from mqdedup.db.engine import session_factory
from mqdedup.dedup.ids import from_callable

QUEUE = "callbacks"


class Broken(Consumer):
    """Both hooks raise; the handler counts its runs."""

    name = "broken-hooks"
    batch_size = 8
    runs: Counter[str]
    duplicates: Counter[str]

    def __init__(self) -> None:
        self.runs, self.duplicates = Counter(), Counter()

    def handle(self, message: Message, ctx: Context) -> Any:
        self.runs[str(message.id)] += 1
        return {"done": message.id}

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        self.duplicates[str(message.id)] += 1
        raise ValueError("on_duplicate is broken")

    def after_commit(self, messages: Sequence[Message]) -> None:
        raise ValueError("after_commit is broken")


def test_raising_hooks_change_no_fate(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    for n in range(6):  # each message with its copy right behind it (same batch) ...
        broker.publish(QUEUE, b"{}", message_id=f"m-{n}")
        broker.publish(QUEUE, b"{}", message_id=f"m-{n}")
    consumer = Broken()
    run_until_idle(consumer, broker.transport(QUEUE), sqlite_engine)
    for n in range(6):  # ... and once more later (a duplicate found by the claim)
        broker.publish(QUEUE, b"{}", message_id=f"m-{n}")
    run_until_idle(consumer, broker.transport(QUEUE), sqlite_engine)

    ids = [f"m-{n}" for n in range(6)]
    assert consumer.runs == dict.fromkeys(ids, 1)
    assert consumer.duplicates == dict.fromkeys(ids, 2)
    assert broker.settled_count[QUEUE] == 18 and broker.pending(QUEUE) == 0
    assert broker.dead_letters.get(QUEUE, []) == []


def raising_strategy(message: Message) -> str:
    body = message.json()
    if "id" not in body:
        raise KeyError("id")
    return str(body["id"])


class Identified(Consumer):
    name = "raising-strategy"
    message_id_strategy = from_callable(raising_strategy)

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


def test_a_raising_strategy_in_a_replay_dry_run_counts_its_message(
    sqlite_engine: Engine,
) -> None:
    report = ReplayReport(dry_run=True)
    tally = ReplayTally(Identified(), session_factory(sqlite_engine), report)
    bodies = [{"id": "a"}, {"no": "id"}, {"id": "b"}]
    messages = [Message(body=json.dumps(body).encode()) for body in bodies]
    tally.dry([Delivery(message, n) for n, message in enumerate(messages)])
    assert (report.new, report.without_id) == (2, 1)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_raising_strategy_dead_letters_its_message_alone(
    sqlite_engine: Engine, batch_size: int
) -> None:
    broker = InMemoryBroker()
    for body in ({"id": "a"}, {"no": "id"}, {"id": "b"}):
        broker.publish(QUEUE, json.dumps(body))
    consumer = Identified()
    consumer.batch_size = batch_size
    metrics = run_until_idle(consumer, broker.transport(QUEUE), sqlite_engine)
    assert metrics.processed == 2
    [letter] = broker.dead_letters[QUEUE]
    assert "the message id strategy failed: KeyError" in letter.record.reason
