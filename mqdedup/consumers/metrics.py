"""Counters every consumer keeps; transports add lag."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from mqdedup.histograms import Histograms


@dataclass
class Metrics:
    """What one consumer has done since it started."""

    delivered: int = 0
    processed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    #: Dead-letter publishes that failed (the broker refused the record or was down).
    dead_letter_failures: int = 0
    #: Dead letters kept in the database table because the broker refused them.
    dead_letters_parked: int = 0
    retries: int = 0
    failures: int = 0
    database_retries: int = 0
    #: What the worker is waiting for while it cannot make progress (the database or
    #: Redis unreachable); None: nothing. ``/healthz`` is not ready meanwhile.
    outage: str | None = None
    #: How often a pool gave no connection: SQLAlchemy's pool timed out, or a pooler's
    #: queue did (PgBouncer ``query_wait_timeout``).
    pool_timeouts: int = 0
    #: The error of the last pool that gave no connection, until a unit of work commits
    #: processed messages again; ``/healthz`` is not ready meanwhile.
    connection_shortage: str | None = None
    batches: int = 0
    batch_seconds: float = 0.0
    lag: dict[str, int] = field(default_factory=dict)
    #: True while the transport has a consumer attached to the broker, False while it is
    #: detached (reconnecting, channel closed by the broker); None: not reported.
    consumer_attached: bool | None = None
    #: Why the broker fenced this consumer (Kafka static membership: another member took
    #: its instance id); None: not fenced. ``/healthz`` is not ready meanwhile.
    fenced: str | None = None
    #: How often the consuming channel was opened again after the broker closed it or the
    #: connection was lost.
    channel_reopens: int = 0
    #: Latency histograms by name (:data:`mqdedup.histograms.HISTOGRAMS`).
    histograms: Histograms = field(default_factory=Histograms, repr=False)

    def snapshot(self, *, histograms: bool = True) -> dict[str, Any]:
        """A plain copy for the metrics endpoint (``histograms=False``: for a log line)."""
        data = {
            item.name: copy.copy(getattr(self, item.name))
            for item in fields(self)
            if item.name != "histograms"
        }
        if histograms:
            data["histograms"] = self.histograms.snapshot()
        return data
