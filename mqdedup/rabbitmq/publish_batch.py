"""One relay batch on a confirm-mode channel: which records are in flight, returned or
published alone, and which of them the broker's channel-close text points at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mqdedup.outbox.publishers import OutboxRecord, PublishResult
from mqdedup.rabbitmq.publish_refusals import MAX_SIZE, user_id_of


@dataclass
class Batch:
    """The records of one publishing round and their state on the channel."""

    records: Sequence[OutboxRecord]
    results: list[PublishResult | None]
    order: list[int]
    suspects: set[int] = field(default_factory=set)
    position: int = 0
    inflight: dict[int, int] = field(default_factory=dict)  # delivery tag -> record index
    returned: dict[int, PublishResult] = field(default_factory=dict)
    by_message_id: dict[str, int] = field(default_factory=dict)
    alone: int | None = None  # index of the record published alone, until confirmed

    @property
    def done(self) -> bool:
        """Every record was sent and confirmed (or settled without sending)."""
        return self.position >= len(self.order) and not self.inflight

    def unconfirmed(self) -> list[int]:
        """Indices in flight or not sent yet, in the batch's order."""
        return sorted(self.inflight.values()) + self.order[self.position :]


def match_culprit(batch: Batch, code: int | None, text: str) -> int | None:
    """The unconfirmed record the broker's close text points at (first match)."""
    inflight = sorted(batch.inflight.values())
    for index in inflight:
        record = batch.records[index]
        user_id = user_id_of(record)
        size = MAX_SIZE.search(text)
        if code == 406 and user_id is not None and f"'{user_id}'" in text:
            return index
        if code == 406 and size is not None and len(record.payload) > int(size.group(1)):
            return index
        if code in (403, 404) and f"exchange '{record.destination}'" in text:
            return index
    return None
