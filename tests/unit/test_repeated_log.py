"""A waiting line is written once, then at a growing interval (1 s, 2 s, 4 s ... 60 s), with
the count of repeats left out: the relay's lease takeover and a paused broker use it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mqdedup.logs import MAX_INTERVAL, RepeatedLog
from mqdedup.outbox import coordination, relay_publishing
from mqdedup.outbox.coordination import LEASE_WAIT, LeaseTakeover
from mqdedup.outbox.publishers import PublishResult
from mqdedup.outbox.relay_publishing import BROKER_WAIT, BrokerPauses


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == message]


def test_a_line_every_half_second_for_a_minute_is_written_six_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    repeats = RepeatedLog(logging.getLogger("mqdedup.test"), clock=clock)
    written_at = []
    with caplog.at_level(logging.INFO, logger="mqdedup.test"):
        for _ in range(121):  # 0 s, 0.5 s, ... 60 s
            if repeats.info("waiting", extra={"relay": "r1"}):
                written_at.append(clock.now - 1000.0)
            clock.now += 0.5
    assert written_at == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0]  # then 63 s: past the minute
    lines = _lines(caplog, "waiting")
    assert len(lines) == 6
    assert all(r.relay == "r1" for r in lines)  # type: ignore[attr-defined]
    assert not hasattr(lines[0], "suppressed")  # the first line left nothing out
    suppressed = [r.suppressed for r in lines[1:]]  # type: ignore[attr-defined]
    assert suppressed == [1, 3, 7, 15, 31]  # every call is written or counted
    assert 6 + sum(suppressed) + 58 == 121  # the 58 calls after 31 s wait for the 63 s line


def test_the_interval_is_capped_and_a_new_wait_starts_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    repeats = RepeatedLog(logging.getLogger("mqdedup.test"), clock=clock)
    with caplog.at_level(logging.INFO, logger="mqdedup.test"):
        for _ in range(2000):  # a waiting line every second for 2000 s
            repeats.info("waiting")
            clock.now += 1.0
        times = [r.created for r in _lines(caplog, "waiting")]
        assert len(times) <= 6 + 2000 // int(MAX_INTERVAL) + 1  # at most one a minute later on
        caplog.clear()
        repeats.done("waiting")
        assert repeats.info("waiting")  # the wait ended: the next one is a new wait
        assert not repeats.info("waiting")
        clock.now += MAX_INTERVAL + 1  # quiet for longer than the cap: a new wait too
        assert repeats.info("waiting")
    # Each key is its own wait: two relays in one process both say it at once.
    assert repeats.info("other", key="relay-a") and repeats.info("other", key="relay-b")


class _Store:
    """A store whose foreign leases hold the given shards."""

    def __init__(self) -> None:
        self.held: set[int] = {3}

    def foreign_leases(self, _engine: Any, _relay_id: str) -> set[int]:
        return set(self.held)


def test_the_relay_lease_takeover_says_it_waits_once_then_less_often(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(coordination._WAITS, "clock", clock)
    store = _Store()
    takeover = LeaseTakeover(None, store, "relay-1")  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="mqdedup.outbox.coordination"):
        for _ in range(120):  # a claim every 0.5 s for a minute, the lease still live
            assert takeover.claimable({3}) == set()
            clock.now += 0.5
        waits = _lines(caplog, LEASE_WAIT)
        assert len(waits) == 6  # was 120 lines
        assert waits[0].shards == [3]  # type: ignore[attr-defined]
        store.held = set()  # the lease expired
        assert takeover.claimable({3}) == {3}
        caplog.clear()
        store.held = {5}  # a later takeover is a new wait: said at once
        assert takeover.claimable({3, 5}) == {3}
        assert len(_lines(caplog, LEASE_WAIT)) == 1


def test_a_paused_broker_says_so_once_then_less_often(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(relay_publishing._WAITS, "clock", clock)
    pauses = BrokerPauses(["kafka"], backoff_max=10.0)
    down = [PublishResult.unavailable("connection refused")]
    with caplog.at_level(logging.INFO, logger="mqdedup.outbox.relay_publishing"):
        for _ in range(100):
            pauses.record("kafka", down)
            clock.now += 0.5
        assert len(_lines(caplog, BROKER_WAIT)) == 6
        pauses.record("kafka", [PublishResult(relay_publishing.PublishOutcome.PUBLISHED)])
        caplog.clear()
        pauses.record("kafka", down)  # a new outage: said at once
        assert len(_lines(caplog, BROKER_WAIT)) == 1


def test_waits_left_unended_are_forgotten_once_quiet() -> None:
    clock = Clock()
    repeats = RepeatedLog(logging.getLogger("mqdedup.test"), clock=clock)
    for n in range(300):  # relays that stopped while waiting never call done()
        repeats.info("waiting", key=f"relay-{n}")
    clock.now += MAX_INTERVAL + 1
    repeats.info("waiting", key="relay-new")
    assert list(repeats._waits) == [("waiting", "relay-new")]
