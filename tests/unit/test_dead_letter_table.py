"""Dead letters the broker refuses are kept in the database; replay and delete them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from mqdedup import InMemoryBroker, Metrics, RetryPolicy
from mqdedup.cli.dead_letters import delete_dead_letters, replay_dead_letters
from mqdedup.consumers.memory import MemoryTransport
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import schema
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from tests.support import OrderConsumer, orders

FAST = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)


class RefusingTransport(MemoryTransport):
    """A broker whose dead-letter target refuses some records (e.g. too large)."""

    refuse: frozenset[str] = frozenset()
    unavailable: frozenset[str] = frozenset()

    def dead_letter(self, delivery: Delivery[int], record: DeadLetter) -> None:
        if delivery.message.id in self.refuse or not delivery.message.id:
            raise DeadLetterRefusedError("MessageSizeTooLargeError: the record is too large")
        if delivery.message.id in self.unavailable:
            raise BrokerUnavailableError("the broker is down")
        super().dead_letter(delivery, record)


class Orders(OrderConsumer):
    retry_policy = FAST
    fail_ids = frozenset({"m3", "m7"})


def _publish(broker: InMemoryBroker, count: int) -> None:
    for number in range(count):
        broker.publish(
            "orders",
            json.dumps({"order": number, "amount": number}),
            message_id=f"m{number}",
            headers={"trace": b"\x00\x01", "text": "caf\u00e9"},
        )


def _transport(broker: InMemoryBroker, **refusals: frozenset[str]) -> RefusingTransport:
    transport = RefusingTransport(broker, "orders")
    for name, ids in refusals.items():
        setattr(transport, name, ids)
    return transport


def _order_rows(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(orders)).scalar_one())


def test_a_refused_dead_letter_is_kept_in_the_database_and_settled(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker(seed=1)
    _publish(broker, 10)
    broker.publish("orders", b"{not json", message_id=None)  # no id: refused as well
    metrics = Metrics()
    transport = _transport(broker, refuse=frozenset({"m3"}))
    Worker(Orders(), transport, sqlite_engine, metrics=metrics).run(until_idle=True)

    assert broker.pending("orders") == 0 and transport.in_flight == 0  # all settled
    assert _order_rows(sqlite_engine) == 8  # m3 and m7 failed; the others once
    assert [d.message.header("message-id") for d in broker.dead_letters["orders"]] == ["m7"]
    with Session(sqlite_engine) as session:
        kept = DeadLetterTable().list(session)
    assert sorted(str(row.message.id) for row in kept) == ["None", "m3"]
    poison = next(row for row in kept if row.message.id == "m3")
    assert poison.consumer_name == "orders"
    assert poison.attempts == 2
    assert "handler failed after 2 attempts" in poison.reason
    assert "too large" in poison.refusal
    assert json.loads(poison.message.body) == {"order": 3, "amount": 3}
    assert poison.message.headers["trace"] == b"\x00\x01"
    assert poison.message.headers["text"] == "caf\u00e9"
    assert poison.message.coordinates == "orders/0/3"
    assert metrics.dead_letter_failures == 2 and metrics.dead_letters_parked == 2
    assert metrics.dead_lettered == 2 + 1


def test_a_dead_letter_that_fails_for_an_outage_stays_unsettled(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker(seed=1)
    _publish(broker, 5)
    metrics = Metrics()
    transport = _transport(broker, unavailable=frozenset({"m3"}))
    Worker(Orders(), transport, sqlite_engine, metrics=metrics).run(max_batches=1)
    assert metrics.dead_letter_failures == 1 and metrics.dead_letters_parked == 0
    with Session(sqlite_engine) as session:
        assert DeadLetterTable().list(session) == []
    assert broker.pending("orders") == 1  # given back on close: nothing lost


def test_replay_runs_the_fixed_handler_and_removes_the_rows(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker(seed=1)
    _publish(broker, 10)
    Worker(
        Orders(), _transport(broker, refuse=frozenset({"m3", "m7"})), sqlite_engine
    ).run(until_idle=True)
    assert _order_rows(sqlite_engine) == 8

    class StillBroken(Orders):
        fail_ids = frozenset({"m7"})

    outcome = replay_dead_letters(StillBroken(), sqlite_engine)
    assert (outcome.processed, outcome.dead_lettered_again, outcome.removed) == (1, 1, 1)
    assert _order_rows(sqlite_engine) == 9
    with Session(sqlite_engine) as session:
        assert [row.message.id for row in DeadLetterTable().list(session)] == ["m7"]
    attempts = schema().attempts
    with sqlite_engine.connect() as connection:
        m7_attempts = connection.execute(
            select(attempts.c.attempts).where(attempts.c.message_id == "m7")
        ).scalar_one()
    assert m7_attempts == FAST.max_attempts  # counted anew, not on top of the first run

    class Fixed(Orders):
        fail_ids = frozenset()

    outcome = replay_dead_letters(Fixed(), sqlite_engine)
    assert (outcome.processed, outcome.removed) == (1, 1)
    assert _order_rows(sqlite_engine) == 10
    again = replay_dead_letters(Fixed(), sqlite_engine)
    assert again.handed_out == 0


def test_delete_needs_ids_or_all(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker(seed=1)
    _publish(broker, 10)
    Worker(
        Orders(), _transport(broker, refuse=frozenset({"m3", "m7"})), sqlite_engine
    ).run(until_idle=True)
    with Session(sqlite_engine) as session:
        first = DeadLetterTable().list(session)[0].id
    assert delete_dead_letters(sqlite_engine, "mqdedup_", "orders", [first], False) == 1
    assert delete_dead_letters(sqlite_engine, "mqdedup_", "other", None, True) == 0
    assert delete_dead_letters(sqlite_engine, "mqdedup_", "orders", None, True) == 1
    with pytest.raises(Exception, match="--id"):
        delete_dead_letters(sqlite_engine, "mqdedup_", "orders", None, False)


def test_cli_lists_and_deletes_kept_dead_letters(sqlite_engine: Engine, tmp_path: Path) -> None:
    broker = InMemoryBroker(seed=1)
    _publish(broker, 10)
    Worker(Orders(), _transport(broker, refuse=frozenset({"m3"})), sqlite_engine).run(
        until_idle=True
    )
    url = str(sqlite_engine.url)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mqdedup.cli.main", *args, "--database", url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    listed = cli("dead-letters", "list")
    assert listed.returncode == 0, listed.stderr
    assert "m3" in listed.stdout and "too large" in listed.stdout
    status = cli("status")
    assert status.returncode == 0, status.stderr
    assert "Dead letters kept in the database" in status.stdout and "orders" in status.stdout
    refused = cli("dead-letters", "delete", "--consumer", "orders")
    assert refused.returncode != 0 and "--all" in refused.stderr
    assert "Traceback" not in refused.stderr
    deleted = cli("dead-letters", "delete", "--consumer", "orders", "--all")
    assert deleted.returncode == 0 and "deleted 1" in deleted.stdout
    assert "no dead letters" in cli("dead-letters", "list").stdout


def test_replay_hands_given_back_rows_out_again_first(sqlite_engine: Engine) -> None:
    from mqdedup.consumers.replay import ParkedTransport
    from mqdedup.db.engine import session_factory

    broker = InMemoryBroker(seed=1)
    _publish(broker, 6)
    Worker(Orders(), _transport(broker, refuse=frozenset({"m3", "m7"})), sqlite_engine).run(
        until_idle=True
    )
    transport = ParkedTransport(session_factory(sqlite_engine), "orders")
    first = transport.fetch(10, 0)
    assert [d.message.id for d in first] == ["m3"]
    transport.give_back(first)
    again = transport.fetch(10, 0)
    assert [(d.message.id, d.message.redelivered) for d in again] == [("m3", True)]
    transport.settle(again)
    assert transport.fetch(10, 0) == [] and transport.settled == 1
