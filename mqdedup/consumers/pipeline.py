"""What a unit of work sees of the Processor (so its modules need not import it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mqdedup.consumers.base import Consumer
    from mqdedup.consumers.dead_lettering import DeadLettering
    from mqdedup.consumers.handling import Handlers
    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.report import BatchReport, Outcome
    from mqdedup.consumers.transport import Delivery
    from mqdedup.dedup.claims import ClaimStore
    from mqdedup.outages import Outages
    from mqdedup.stopping import StopToken


class Pipeline(Protocol):
    """The Processor's parts a claim store's unit of work and careful mode use."""

    consumer: Consumer
    name: str
    store: ClaimStore
    metrics: Metrics
    stop: StopToken
    handlers: Handlers
    letters: DeadLettering
    #: Waits out outages of the claim store.
    outages: Outages
    #: When the last claim became durable (for the commit -> settle histogram).
    last_commit: float | None

    def committed(self, outcome: Outcome, report: BatchReport) -> None:
        """Record a durable unit of work in ``report`` (hooks, duplicate callbacks)."""
        ...

    def log_failure(self, delivery: Delivery[Any] | None, error: Exception) -> None:
        """One line per failed handler call."""
        ...
