"""State transitions against real PostgreSQL and MariaDB: 50 concurrent callers, one winner."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from mqdedup.db.schema import schema
from mqdedup.dedup.transitions import (
    StateMachine,
    TransitionOutcome,
    TransitionResult,
    run_transaction,
)
from mqdedup.outbox.writer import OutboxWriter
from tests.integration.tools.conftest import Database, lock_waiters
from tests.services import wait_for

pytestmark = pytest.mark.integration

EDGES = {"CREATED": {"PAID", "CLOSED"}, "PAID": {"REFUNDED"}}
THREADS = 50
BLOCKED = 40  # callers that must be seen waiting on the winner's row lock at once


def test_50_threads_firing_the_same_transition(database: Database) -> None:
    """Exactly one `applied`, 49 `already in target state`, one outbox row."""
    accounts = database.business.accounts
    outbox = schema(database.prefix).outbox
    machine = StateMachine(accounts, EDGES, version_column="version")
    with database.engine.begin() as connection:
        connection.execute(insert(accounts).values(id=1, state="CREATED", version=0))

    barrier = threading.Barrier(THREADS)
    results: list[TransitionResult] = []
    errors: list[BaseException] = []
    runs = Counter[str]()
    lock = threading.Lock()
    most_waiting = 0

    def others_blocked() -> bool:
        nonlocal most_waiting
        waiting = lock_waiters(database.engine, accounts.name)
        most_waiting = max(most_waiting, waiting)
        return waiting >= BLOCKED

    def pay(session: Session) -> TransitionResult:
        with lock:
            runs[threading.current_thread().name] += 1
        result = machine.transition(session, 1, to="PAID")
        if result.applied:
            OutboxWriter(session, prefix=database.prefix).publish(
                {"account": 1, "event": "paid"}, topic="account-events", key="1"
            )
            # Hold the winner's transaction until the others pile up on the row lock,
            # so that the test exercises a real race rather than 50 calls in a row.
            wait_for(others_blocked, 30, "the other callers to block on the row")
        return result

    def fire() -> None:
        try:
            barrier.wait(timeout=30)
            # As in a consumer: a transient error (an InnoDB deadlock report when many
            # transactions queue on one row) reruns the whole transaction.
            result = run_transaction(database.engine, pay)
            with lock:
                results.append(result)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=fire, name=f"caller-{n}") for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    reruns = sum(runs.values()) - THREADS
    print(f"most callers blocked at once: {most_waiting}; transactions rerun: {reruns}")

    outcomes = Counter(result.outcome for result in results)
    assert outcomes == {TransitionOutcome.APPLIED: 1, TransitionOutcome.ALREADY_IN_TARGET: 49}
    assert most_waiting >= BLOCKED  # the others really were blocked while the winner held it
    assert all(r.current_state == "PAID" for r in results)
    with database.engine.connect() as connection:
        row = connection.execute(select(accounts.c.state, accounts.c.version)).one()
        side_effects = connection.execute(
            select(func.count()).select_from(outbox).where(outbox.c.destination == "account-events")
        ).scalar_one()
    assert tuple(row) == ("PAID", 1)  # moved once, version bumped once
    assert side_effects == 1


def test_illegal_transition_is_rejected_with_the_current_state(database: Database) -> None:
    accounts = database.business.accounts
    outbox = schema(database.prefix).outbox
    machine = StateMachine(accounts, EDGES, version_column="version")
    with database.engine.begin() as connection:
        connection.execute(insert(accounts).values(id=7, state="REFUNDED", version=3))

    def pay(session: Session) -> TransitionResult:
        result = machine.transition(session, 7, to="PAID")
        if result.applied:
            OutboxWriter(session, prefix=database.prefix).publish({"paid": 7}, topic="x")
        return result

    with Session(database.engine) as session, session.begin():
        result = pay(session)
    assert result.rejected
    assert str(result) == "rejected: illegal from REFUNDED"
    assert (result.current_state, result.version) == ("REFUNDED", 3)
    assert database.count(outbox) == 0
    with database.engine.connect() as connection:
        assert tuple(connection.execute(select(accounts.c.state, accounts.c.version)).one()) == (
            "REFUNDED",
            3,
        )


def test_rolled_back_transition_and_side_effect_leave_nothing(database: Database) -> None:
    """The side effect shares the transaction: a rollback undoes both; a rerun applies."""
    accounts = database.business.accounts
    outbox = schema(database.prefix).outbox
    machine = StateMachine(accounts, EDGES)
    with database.engine.begin() as connection:
        connection.execute(insert(accounts).values(id=9, state="CREATED", version=0))

    def attempt(fail: bool) -> Any:
        with Session(database.engine) as session, session.begin():
            result = machine.transition(session, 9, to="CLOSED")
            if result.applied:
                OutboxWriter(session, prefix=database.prefix).publish({"closed": 9}, topic="x")
            if fail:
                raise RuntimeError("the handler failed after the transition")
            return result

    with pytest.raises(RuntimeError):
        attempt(fail=True)
    assert database.count(outbox) == 0
    assert attempt(fail=False).applied  # the retry applies it: nothing was half-done
    assert attempt(fail=False).already_in_target
    assert database.count(outbox) == 1
