"""Counters every consumer keeps; transports add lag."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    batches: int = 0
    batch_seconds: float = 0.0
    lag: dict[str, int] = field(default_factory=dict)
    #: True while the transport has a consumer attached to the broker, False while it is
    #: detached (reconnecting, channel closed by the broker); None: not reported.
    consumer_attached: bool | None = None
    #: How often the consuming channel was opened again after the broker closed it or the
    #: connection was lost.
    channel_reopens: int = 0

    def snapshot(self) -> dict[str, Any]:
        """A plain copy for logging and the metrics endpoint."""
        return asdict(self)
