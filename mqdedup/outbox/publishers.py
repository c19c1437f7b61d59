"""The publisher seam: what the relay needs from a broker client.

A publisher gets a batch of claimed outbox records and returns one
:class:`PublishResult` per record, in order. Its contract:

* records are sent in the order given (the relay's per-key order depends on it);
* ``PUBLISHED`` only once the broker has durably accepted the record (Kafka
  ``acks=all`` after a flush, RabbitMQ publisher confirm);
* ``REJECTED`` for the record's *own* failure (unroutable, too large, unknown
  destination): the relay retries it with backoff and marks it failed after its
  attempts;
* ``UNAVAILABLE`` when the broker cannot be reached or did not answer in time: the
  relay puts the record back without counting an attempt and waits for the broker;
* ``publish_batch`` does not raise for broker failures; it reports them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol, runtime_checkable


class PublishOutcome(enum.Enum):
    """What became of one record."""

    PUBLISHED = "published"
    REJECTED = "rejected"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of publishing one record, with the error text when it failed."""

    outcome: PublishOutcome
    error: str | None = None

    @classmethod
    def rejected(cls, error: str) -> PublishResult:
        """The record's own failure; it is retried, then marked failed."""
        return cls(PublishOutcome.REJECTED, error)

    @classmethod
    def unavailable(cls, error: str) -> PublishResult:
        """The broker's failure; the record waits for the broker, attempts unchanged."""
        return cls(PublishOutcome.UNAVAILABLE, error)

    @property
    def ok(self) -> bool:
        """True when the broker accepted the record."""
        return self.outcome is PublishOutcome.PUBLISHED


PUBLISHED = PublishResult(PublishOutcome.PUBLISHED)


class OutboxRecord(NamedTuple):
    """One claimed outbox row, as the relay hands it to a publisher (read-only).

    ``destination`` is the Kafka topic or the RabbitMQ exchange; ``routing_key`` is
    ``None`` for Kafka. ``key`` is the Kafka record key (for RabbitMQ only the ordering
    key). ``headers`` already hold ``message-id`` and, when known, ``causation-id`` and
    the trace context; ``properties`` are AMQP basic properties (with ``message_id``).
    """

    id: int
    message_id: str
    broker: str
    destination: str
    routing_key: str | None
    key: bytes | None
    headers: Mapping[str, Any]
    properties: Mapping[str, Any] | None
    payload: bytes
    attempts: int
    created_at: datetime


@runtime_checkable
class Publisher(Protocol):
    """Sends outbox records to one broker (see the module's contract)."""

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        """Send ``records`` in order; return one result per record."""
        ...

    def keepalive(self) -> None:
        """Service the connection while the relay is idle (heartbeats)."""
        ...

    def close(self) -> None:
        """Flush what can be flushed and release the connection."""
        ...


def header_text(value: Any) -> str:
    """A stored header value as the text sent on the wire."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else str(value)
