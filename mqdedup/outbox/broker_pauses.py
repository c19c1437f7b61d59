"""Backoff of the relay's brokers while they are unavailable (:class:`BrokerPauses`)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mqdedup.outbox.publishers import Outcome, PublishResult

log = logging.getLogger(__name__)


@dataclass
class _BrokerState:
    """Backoff of one broker while it is unavailable."""

    failures: int = 0
    paused_until: float = 0.0


class BrokerPauses:
    """Which brokers are paused, and until when, after their rows came back unavailable."""

    def __init__(self, brokers: Iterable[str], backoff_max: float) -> None:
        self._brokers: dict[str, _BrokerState] = {name: _BrokerState() for name in brokers}
        self._backoff_max = backoff_max

    def record(self, broker: str, results: Sequence[PublishResult]) -> bool:
        """Note ``broker``'s results of one batch; True when an outage begins."""
        state = self._brokers[broker]
        down = [r for r in results if r.outcome is Outcome.UNAVAILABLE]
        if not down:
            if state.failures:
                log.info("broker available again", extra={"broker": broker})
            state.failures = 0
            state.paused_until = 0.0
            return False
        state.failures += 1
        pause = min(self._backoff_max, 0.25 * 2 ** (state.failures - 1)) * random.uniform(0.8, 1.0)
        state.paused_until = time.monotonic() + pause
        log.warning(
            "broker unavailable; its rows wait",
            extra={
                "broker": broker,
                "rows": len(down),
                "retry_in": round(pause, 2),
                "consecutive": state.failures,
                "error": down[0].error,
            },
        )
        return state.failures == 1

    def paused(self) -> set[str]:
        """The brokers paused now."""
        now = time.monotonic()
        return {name for name, state in self._brokers.items() if state.paused_until > now}

    def next_retry(self) -> float | None:
        """The earliest end of a pause (``time.monotonic()``), None if none was set."""
        pauses = [s.paused_until for s in self._brokers.values() if s.paused_until]
        return min(pauses) if pauses else None
