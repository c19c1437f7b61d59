"""The outage helper (``mqdedup.outages``): wait out what is transient, flag it, obey stops."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from mqdedup.logs import RepeatedLog
from mqdedup.outages import Outages, StoppedDuringOutageError
from mqdedup.stopping import StopToken


class Down(ConnectionError):
    pass


def flaky(failures: int, calls: list[int]) -> object:
    def work() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise Down(f"down #{len(calls)}")
        return "done"

    return work


def test_an_outage_is_retried_logged_counted_and_flagged_until_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    flags: list[str | None] = []
    retries: list[int] = []
    outages = Outages(
        stop=StopToken(),
        is_transient=lambda error: isinstance(error, Down),
        what="redis",
        backoff_max=0.01,
        on_retry=lambda: retries.append(1),
        on_change=flags.append,
        context={"consumer": "sms"},
    )
    with caplog.at_level(logging.WARNING, logger="mqdedup.outages"):
        assert outages.run(flaky(4, calls)) == "done"  # type: ignore[arg-type]
    assert len(calls) == 5 and len(retries) == 4
    assert flags[:-1] == ["redis unavailable: Down"] * 4 and flags[-1] is None  # ready again
    lines = [r for r in caplog.records if r.getMessage() == "redis unavailable; retrying"]
    # One line for the outage, not one per attempt (the next after 1 s, 2 s, 4 s ...).
    assert [r.attempt for r in lines] == [1]  # type: ignore[attr-defined]
    assert all(r.consumer == "sms" and r.error == "Down" for r in lines)  # type: ignore[attr-defined]


def test_other_errors_are_raised_at_once_and_never_flag() -> None:
    flags: list[str | None] = []
    outages = Outages(stop=StopToken(), is_transient=lambda e: False, on_change=flags.append)

    def broken() -> None:
        raise ValueError("the message's own fault")

    with pytest.raises(ValueError, match="own fault"):
        outages.run(broken)
    assert flags == []


def test_a_stop_ends_the_wait_with_the_callers_exception() -> None:
    class Abandoned(Exception):
        pass

    stop = StopToken()
    calls: list[int] = []
    keepalives: list[int] = []
    outages = Outages(
        stop=stop,
        is_transient=lambda e: isinstance(e, Down),
        backoff_max=30.0,
        keepalive=lambda: keepalives.append(1),
        stopped=Abandoned,
    )
    timer = threading.Timer(0.3, stop.request)
    timer.start()
    try:
        with pytest.raises(Abandoned, match="database was unavailable"):
            outages.run(flaky(10**6, calls))  # type: ignore[arg-type]
    finally:
        timer.cancel()
    assert 2 <= len(calls) < 100 and keepalives  # waited (with keepalives), then gave up
    assert StoppedDuringOutageError is not Abandoned


def test_pause_serves_keepalives_and_reports_a_stop() -> None:
    stop = StopToken()
    keepalives: list[int] = []
    outages = Outages(
        stop=stop,
        is_transient=lambda e: False,
        keepalive=lambda: keepalives.append(1),
        slice_seconds=0.01,
    )
    assert outages.pause(0.05) is True and len(keepalives) >= 2
    stop.request()
    assert outages.pause(5) is False


def test_the_flag_clears_when_the_outage_ends_in_another_error() -> None:
    """Down, then back with a real error: no longer an outage, /healthz may be ready."""
    flags: list[str | None] = []
    calls: list[int] = []
    outages = Outages(
        stop=StopToken(),
        is_transient=lambda e: isinstance(e, Down),
        backoff_max=0.01,
        on_change=flags.append,
    )

    def work() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise Down("down")
        raise ValueError("the message's own fault")

    with pytest.raises(ValueError, match="own fault"):
        outages.run(work)
    assert flags[0] == "database unavailable: Down" and flags[-1] is None


def test_a_long_outage_says_so_again_at_a_growing_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The "retrying" line of one outage is written at once, then after 1 s, 2 s, 4 s ...
    with the attempts left out counted; the next outage starts over at once."""
    now = [0.0]

    def tick_then_flaky(failures: int) -> Any:
        work: Any = flaky(failures, [])

        def run() -> Any:
            now[0] += 0.5  # each attempt half a second later
            return work()

        return run

    outages = Outages(
        stop=StopToken(),
        is_transient=lambda error: isinstance(error, Down),
        what="redis",
        backoff_max=0.001,
    )
    outages._repeats = RepeatedLog(logging.getLogger("mqdedup.outages"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="mqdedup.outages"):
        assert outages.run(tick_then_flaky(12)) == "done"  # type: ignore[arg-type]
        first = [r for r in caplog.records if r.getMessage() == "redis unavailable; retrying"]
        # attempts at 0.5 s steps: written at 0.5 (1st), 1.5 (3rd), 3.5 (7th), 7.5 would be the 15th
        assert [r.attempt for r in first] == [1, 3, 7]  # type: ignore[attr-defined]
        assert [getattr(r, "suppressed", 0) for r in first] == [0, 1, 3]
        caplog.clear()
        assert outages.run(tick_then_flaky(1)) == "done"  # type: ignore[arg-type]
    again = [r for r in caplog.records if r.getMessage() == "redis unavailable; retrying"]
    assert [r.attempt for r in again] == [1]  # type: ignore[attr-defined]
