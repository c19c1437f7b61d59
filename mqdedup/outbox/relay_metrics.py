"""The relay's bookkeeping: what it has done (:class:`RelayMetrics`) and what one cycle did
(:class:`CycleReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mqdedup.histograms import Histograms
from mqdedup.outbox.publishers import OutboxRecord


@dataclass
class RelayMetrics:
    """What one relay has done since it started."""

    batches: int = 0
    claimed: int = 0
    published: int = 0
    rejected: int = 0
    failed: int = 0
    unavailable: int = 0
    broker_outages: int = 0
    database_retries: int = 0
    #: What the relay is waiting for while it cannot make progress (None: nothing).
    outage: str | None = None
    purged: int = 0
    seconds_publishing: float = 0.0
    #: ``publish_delay_seconds``: an outbox row's commit to its confirmed publish.
    histograms: Histograms = field(default_factory=Histograms, repr=False)

    def snapshot(self, *, histograms: bool = True) -> dict[str, Any]:
        """A plain copy for the metrics endpoint (``histograms=False``: for a log line)."""
        data = {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if item.name != "histograms"
        }
        if histograms:
            data["histograms"] = self.histograms.snapshot()
        return data


@dataclass
class CycleReport:
    """What one claim → publish → mark cycle did."""

    claimed: int = 0
    published: list[OutboxRecord] = field(default_factory=list)
    rejected: list[tuple[OutboxRecord, str]] = field(default_factory=list)
    failed: list[OutboxRecord] = field(default_factory=list)
    unavailable: list[OutboxRecord] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every claimed row was published."""
        return len(self.published) == self.claimed
