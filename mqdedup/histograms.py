"""Latency histograms kept by workers and relays, exported on ``/metrics``.

Fixed buckets (seconds), cumulative counts, a sum: the Prometheus histogram model, kept
without prometheus_client so a worker child only ships plain numbers to its supervisor.
"""

from __future__ import annotations

import bisect
from typing import Any

#: Upper bounds in seconds; a last ``+Inf`` bucket is implied.
BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Histogram:
    """Observed durations in :data:`BUCKETS` (not thread-safe: one owner thread)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration."""
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": [(upper bound as text, cumulative count), ...], "sum": s, "count": n}``."""
        cumulative: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*map(repr, BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": self.sum, "count": running}


class Histograms:
    """Histograms by name, made on first use (a worker's or a relay's)."""

    __slots__ = ("_by_name",)

    def __init__(self) -> None:
        self._by_name: dict[str, Histogram] = {}

    def observe(self, name: str, seconds: float) -> None:
        """Count one duration in the histogram ``name``."""
        histogram = self._by_name.get(name)
        if histogram is None:
            histogram = self._by_name[name] = Histogram()
        histogram.observe(seconds)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every histogram's :meth:`Histogram.snapshot`, by name."""
        return {name: histogram.snapshot() for name, histogram in list(self._by_name.items())}


#: The histograms, their help texts and where they are observed.
HISTOGRAMS: dict[str, str] = {
    "handler_seconds": "Duration of one handler call (handle, or handle_batch for a batch)",
    "transaction_seconds": "Duration of one processing transaction, claim to commit",
    "claim_seconds": "Duration of the claim statement of a transaction",
    "settle_seconds": "From the commit to the broker settle of a batch",
    "publish_delay_seconds": "Relay: from an outbox row's commit to its confirmed publish",
}
