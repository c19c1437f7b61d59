"""The outage helper (``mqdedup.outages``): wait out what is transient, flag it, obey stops."""

from __future__ import annotations

import logging
import threading

import pytest

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
    assert [r.attempt for r in lines] == [1, 2, 3, 4]  # type: ignore[attr-defined]
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
