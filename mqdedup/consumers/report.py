"""What a batch came to: the report the Processor returns, and one pass's outcome."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mqdedup.consumers.transport import DeadLetter, Delivery

log = logging.getLogger("mqdedup.consumers.processor")


class BatchAbandonedError(Exception):
    """A stop was requested while the claim store was unreachable; only what had
    committed was settled."""


@dataclass
class BatchReport:
    """Where each delivery of a batch ended."""

    processed: list[Delivery[Any]] = field(default_factory=list)
    duplicates: list[Delivery[Any]] = field(default_factory=list)
    dead_lettered: list[tuple[Delivery[Any], DeadLetter]] = field(default_factory=list)
    unsettled: list[Delivery[Any]] = field(default_factory=list)
    #: Handler results by message id: stored by this batch, or (when ``on_duplicate``
    #: is overridden) read back for its duplicates. Repeats inside the batch get them.
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def settled(self) -> list[Delivery[Any]]:
        """Deliveries handed to ``Transport.settle``."""
        return self.processed + self.duplicates + [d for d, _ in self.dead_lettered]


@dataclass
class WorkOutcome:
    """What one unit of work did (a committed transaction, a round of Redis claims)."""

    processed: list[Delivery[Any]] = field(default_factory=list)
    duplicates: list[Delivery[Any]] = field(default_factory=list)
    failures: list[tuple[Delivery[Any], Exception]] = field(default_factory=list)
    #: Deliveries left for the next owner (a stop while waiting for a busy claim).
    unsettled: list[Delivery[Any]] = field(default_factory=list)
    stored_results: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    #: When its last claim or completion became durable (``time.monotonic()``).
    durable_at: float | None = None

    def add(self, other: WorkOutcome) -> None:
        """Add what another (committed) unit of work did."""
        self.processed.extend(other.processed)
        self.duplicates.extend(other.duplicates)
        self.failures.extend(other.failures)
        self.unsettled.extend(other.unsettled)
        self.stored_results.update(other.stored_results)
        self.results.update(other.results)
        if other.durable_at is not None:
            self.durable_at = other.durable_at


#: The most characters of an error's text in the "handler failed" line: a database
#: error's text carries its whole statement (hundreds of KB for a bulk insert).
LOGGED_ERROR_CHARS = 2000


def logged_error(error: BaseException) -> str:
    """``Type: text`` of ``error``, its text cut to :data:`LOGGED_ERROR_CHARS`."""
    text = f"{type(error).__name__}: {error}"
    if len(text) <= LOGGED_ERROR_CHARS:
        return text
    return f"{text[:LOGGED_ERROR_CHARS]}… ({len(text) - LOGGED_ERROR_CHARS:,} more characters)"


def log_failure(consumer: str, delivery: Delivery[Any] | None, error: Exception) -> None:
    """One line per failed handler call (the error's text cut to a readable length; the
    dead letter keeps its own reason)."""
    log.info(
        "handler failed",
        extra={
            "consumer": consumer,
            "message_id": delivery.message.id if delivery else None,
            "error": logged_error(error),
        },
    )
