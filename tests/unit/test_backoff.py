"""The one backoff (issue 41): every wait of mqdedup goes through
:class:`mqdedup.backoff.Backoff`, and each one waits what it waited before the formulas
were merged (the old formulas are written out here, with the random draw pinned to the
ends of its range)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
from tenacity import RetryCallState, wait_random_exponential

from mqdedup.backoff import FULL_JITTER, Backoff
from mqdedup.consumers.spec import RetryPolicy
from mqdedup.outbox.publishers import PublishResult
from mqdedup.outbox.relay import RelayConfig
from mqdedup.outbox.relay_publishing import BrokerPauses


@pytest.fixture(params=["low", "high"])
def draw(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``random.uniform`` pinned to one end of its range (for old and new formulas)."""
    end = request.param

    def uniform(low: float, high: float) -> float:
        return low if end == "low" else high

    monkeypatch.setattr(random, "uniform", uniform)
    yield end


def _end(low: float, high: float, end: str) -> float:
    return low if end == "low" else high


def test_the_retry_policy_waits_as_before(draw: str) -> None:
    policy = RetryPolicy(initial_backoff=0.2, max_backoff=3.0, multiplier=3.0, jitter=0.25)
    for failed in range(1, 8):
        before = min(3.0, 0.2 * 3.0 ** (failed - 1)) * (1 + _end(-0.25, 0.25, draw))
        assert policy.backoff(failed) == pytest.approx(before)


def test_a_refused_outbox_row_waits_as_before(draw: str) -> None:
    config = RelayConfig(initial_backoff=1.0, max_backoff=300.0)
    for attempts in range(1, 12):
        before = min(300.0, 1.0 * 2.0 ** (attempts - 1)) * _end(0.9, 1.1, draw)
        assert config.row_backoff(attempts) == pytest.approx(before)


def test_an_unavailable_broker_is_paused_as_before(
    draw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("mqdedup.outbox.relay_publishing.time.monotonic", lambda: clock[0])
    pauses = BrokerPauses(["kafka"], backoff_max=10.0)
    for failures in range(1, 9):
        pauses.record("kafka", [PublishResult.unavailable("down")])
        before = min(10.0, 0.25 * 2 ** (failures - 1)) * _end(0.8, 1.0, draw)
        assert pauses.next_retry() == pytest.approx(clock[0] + before)


def test_full_jitter_is_tenacitys_random_exponential(draw: str) -> None:
    """Outages (multiplier 0.1) and RabbitMQ reconnects (0.2) used tenacity's wait."""
    for multiplier, maximum in ((0.1, 5.0), (0.2, 10.0)):
        ours = Backoff(multiplier, maximum, jitter=FULL_JITTER)
        theirs = wait_random_exponential(multiplier=multiplier, max=maximum)
        for attempt in range(1, 12):
            state = _state(attempt)
            assert ours(state) == pytest.approx(theirs(state))


def test_waits_without_jitter_and_growing_waits_are_as_before() -> None:
    # Worker: unsettled deliveries given back; supervisor: a child restarted.
    for rounds in range(1, 10):
        assert Backoff(0.5, 5.0).delay(rounds) == min(5.0, 0.5 * 2 ** (rounds - 1))
    for restarts in range(0, 10):
        assert Backoff(0.5, 30.0).delay(restarts + 1) == min(30.0, 0.5 * 2**restarts)
    pause = 1.0
    for _ in range(6):  # RabbitMQ dead letters while the broker blocks publishers
        assert Backoff(1.0, 5.0).after(pause) == min(pause * 2, 5.0)
        pause = Backoff(1.0, 5.0).after(pause)


def test_run_transaction_sleeps_as_before(draw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    from mqdedup.dedup.transitions import run_transaction

    slept: list[float] = []
    monkeypatch.setattr("mqdedup.dedup.transitions.time.sleep", slept.append)
    monkeypatch.setattr("mqdedup.dedup.transitions.is_transient", lambda error: True)

    def work(session: Any) -> None:
        raise OperationalError("SELECT 1", {}, Exception("deadlock"))

    engine = create_engine("sqlite://")
    with pytest.raises(OperationalError):
        run_transaction(engine, work, attempts=4, backoff=0.05)
    engine.dispose()
    before = [0.05 * 2 ** (attempt - 1) * _end(0.5, 1.5, draw) for attempt in (1, 2, 3)]
    assert slept == pytest.approx(before)


def test_a_very_long_outage_waits_the_cap_instead_of_overflowing() -> None:
    assert Backoff(0.1, 5.0).delay(100_000) == 5.0
    assert 0.0 <= Backoff(0.1, 5.0, jitter=FULL_JITTER).delay(100_000) <= 5.0
    assert Backoff(1.0).delay(3) == 4.0 and math.isinf(Backoff(1.0).maximum)


def _state(attempt: int) -> RetryCallState:
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return state
