"""An outage is a database that does not answer (issue 39): ``Outages.run(blame=True)``
asks the probe after an error that looks like an outage; the database answering twice
makes the error the work's (``NotAnOutageError``), a probe that fails is an outage,
waited out. And the client-side limit psycopg refuses is never transient."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import QueuePool

from mqdedup.db.dialects import driver_limit, is_contention, is_data_error, is_transient
from mqdedup.db.probe import pool_gives_two
from mqdedup.outages import NotAnOutageError, Outages, StoppedDuringOutageError
from mqdedup.stopping import StopToken


class Dropped(ConnectionError):
    pass


def failing(failures: int, calls: list[int]) -> Callable[[], str]:
    def work() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise Dropped(f"dropped #{len(calls)}")
        return "done"

    return work


def outages(answers: list[bool], retries: list[int], flags: list[str | None]) -> Outages:
    replies = iter(answers)
    return Outages(
        stop=StopToken(),
        is_transient=lambda error: isinstance(error, Dropped),
        backoff_max=0.01,
        on_retry=lambda: retries.append(1),
        on_change=flags.append,
        answers=lambda _error: next(replies),
    )


def test_an_error_that_recurs_while_the_database_answers_is_the_works() -> None:
    calls: list[int] = []
    retries: list[int] = []
    flags: list[str | None] = []
    with pytest.raises(NotAnOutageError) as raised:
        outages([True, True], retries, flags).run(failing(99, calls), blame=True)
    assert isinstance(raised.value.error, Dropped)
    assert len(calls) == 2  # once more at once, then it is the work's
    assert len(retries) == 1 and flags == []  # one retry, never flagged as an outage


def test_a_database_that_answers_after_a_dropped_connection_just_runs_again() -> None:
    calls: list[int] = []
    retries: list[int] = []
    flags: list[str | None] = []
    assert outages([True], retries, flags).run(failing(1, calls), blame=True) == "done"
    assert len(calls) == 2 and len(retries) == 1 and flags == []


def test_a_probe_that_fails_is_an_outage_waited_out_without_blame() -> None:
    calls: list[int] = []
    retries: list[int] = []
    flags: list[str | None] = []
    result = outages([False] * 4, retries, flags).run(failing(4, calls), blame=True)
    assert result == "done" and len(calls) == 5
    assert len(retries) == 4 and flags[0] == "database unavailable: Dropped" and flags[-1] is None


def test_without_again_one_answered_failure_is_the_works() -> None:
    calls: list[int] = []
    with pytest.raises(NotAnOutageError):
        outages([True], [], []).run(failing(99, calls), blame=True, again=False)
    assert len(calls) == 1


def test_work_that_is_not_blamed_never_asks_the_probe() -> None:
    calls: list[int] = []
    retries: list[int] = []
    assert outages([], retries, []).run(failing(2, calls)) == "done"  # answers() not called
    assert len(retries) == 2


def psycopg_error(orig: Exception, params: object) -> sa_exc.OperationalError:
    return sa_exc.OperationalError("INSERT …", params, orig)


def test_psycopgs_parameter_limit_is_the_messages_never_an_outage() -> None:
    refused = psycopg.OperationalError("sending query and params failed")
    error = psycopg_error(refused, {f"p{n}": n for n in range(80_000)})
    reason = driver_limit(error)
    assert reason is not None and reason.startswith(
        "statement has 80,000 parameters; psycopg allows 65,535"
    )
    assert not is_transient(error) and is_data_error(error)
    # the same class with a statement under the limit: a lost connection, transient
    lost = psycopg_error(psycopg.OperationalError("server closed the connection"), (1, 2))
    assert driver_limit(lost) is None and is_transient(lost)


def test_contention_is_retried_without_a_probe() -> None:
    deadlock = psycopg_error(psycopg.errors.DeadlockDetected("deadlock detected"), {})
    lost = psycopg_error(psycopg.OperationalError("server closed the connection"), {})
    assert is_transient(deadlock) and is_contention(deadlock)
    assert is_transient(lost) and not is_contention(lost)


def test_a_stop_requested_meanwhile_ends_the_work_instead_of_running_it_again() -> None:
    """A worker waiting on a pool when SIGTERM came stops after that one wait."""
    calls: list[int] = []
    stop = StopToken()
    outages = Outages(
        stop=stop,
        is_transient=lambda error: isinstance(error, Dropped),
        answers=lambda _error: True,
    )

    def waited_then_stopped() -> str:
        calls.append(1)
        stop.request()  # SIGTERM while the statement waited
        raise Dropped("query_wait_timeout")

    with pytest.raises(StoppedDuringOutageError):
        outages.run(waited_then_stopped, blame=True)
    assert len(calls) == 1


@pytest.mark.parametrize(("pool_size", "max_overflow", "gives"), [(1, 0, False), (1, 1, True)])
def test_a_pool_that_cannot_give_a_second_connection_is_found_at_start(
    tmp_path: Path, pool_size: int, max_overflow: int, gives: bool
) -> None:
    engine = sa_create_engine(
        f"sqlite:///{tmp_path / 'pool.db'}",
        poolclass=QueuePool,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=5,
    )
    try:
        started = time.monotonic()
        assert pool_gives_two(engine, wait=0.5) is gives
        assert time.monotonic() - started < 4.5  # bounded by `wait`, not the pool's timeout
        with engine.connect(), engine.connect() if gives else contextlib.nullcontext():
            pass  # the pool is usable afterwards: nothing was kept
    finally:
        engine.dispose()
