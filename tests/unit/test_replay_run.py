"""ReplayRun: a range transport run by the Worker; the report from Metrics + the ledger."""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import Engine

from mqdedup import Message, RetryPolicy
from mqdedup.consumers.replay import RangeLedger, ReplayRun
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.db.engine import session_factory
from tests.support import OrderConsumer, order_counts


class ListRange:
    """A range transport over a list of messages (a broker's range, without the broker)."""

    def __init__(self, messages: Sequence[Message]) -> None:
        self.ledger = RangeLedger()
        self._todo = [Delivery(message, index) for index, message in enumerate(messages)]
        self._again: list[Delivery] = []
        self.dead_letters: list[DeadLetter] = []
        self.closed = False

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        source = self._again or self._todo
        batch = source[:max_messages]
        del source[:max_messages]
        for delivery in batch:
            self.ledger.handed_out(delivery.token)
        return batch

    def settle(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            self.ledger.settle(delivery.token)

    def give_back(self, deliveries: Sequence[Delivery]) -> None:
        self._again = list(deliveries) + self._again

    def dead_letter(self, delivery: Delivery, record: DeadLetter) -> None:
        self.ledger.dead_lettering(delivery.token, record.reason)
        self.dead_letters.append(record)

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Orders(OrderConsumer):
    batch_size = 4
    fail_ids = frozenset({"m5"})
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)


def _range() -> list[Message]:
    def message(number: int, message_id: str | None) -> Message:
        headers = {"message-id": message_id} if message_id else {}
        return Message(body=json.dumps({"order": number}).encode(), headers=headers)

    messages = [message(n, f"m{n}") for n in range(10)]
    return [*messages[:3], message(99, None), message(2, "m2"), *messages[3:]]


def _replay(engine: Engine, *, dry_run: bool = False) -> tuple[ReplayRun, ListRange]:
    transport = ListRange(_range())
    run = ReplayRun(Orders(), session_factory(engine), transport, dry_run=dry_run)
    run.run()
    return run, transport


def test_a_replay_runs_through_the_processor_and_counts_each_fate(sqlite_engine: Engine) -> None:
    dry, _ = _replay(sqlite_engine, dry_run=True)
    assert (dry.report.new, dry.report.duplicates, dry.report.without_id) == (10, 1, 1)
    assert order_counts(sqlite_engine) == {}  # a dry run writes nothing

    first, transport = _replay(sqlite_engine)
    report = first.report
    assert (report.new, report.duplicates, report.dead_lettered, report.without_id) == (9, 1, 1, 1)
    assert (report.unsettled, report.total) == (0, 12)
    reasons = sorted(d.reason for d in transport.dead_letters)
    assert [reason.split(":")[0] for reason in reasons] == [
        "handler failed after 2 attempts",
        "missing message id",
    ]
    assert transport.closed
    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in range(10) if n != 5}

    again, _ = _replay(sqlite_engine)
    assert (again.report.new, again.report.duplicates) == (0, 10)
    assert (again.report.dead_lettered, again.report.without_id) == (1, 1)


def test_the_ledger_counts_a_dead_letter_only_once_it_is_settled() -> None:
    ledger = RangeLedger()
    ledger.handed_out(1)
    ledger.dead_lettering(1, "handler failed after 3 attempts: boom")
    assert (ledger.dead_lettered, ledger.unsettled) == (0, 1)
    ledger.handed_out(1)  # given back after a failed dead-letter publish, fetched again
    ledger.settle(1)
    assert (ledger.settled, ledger.dead_lettered, ledger.unsettled) == (1, 0, 0)
    ledger.settle(1)  # settled twice: counted once
    assert ledger.settled == 1
