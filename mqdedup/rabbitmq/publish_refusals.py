"""What the broker refused the relay: which record a channel close points at
(:func:`match_culprit`), and the refusals remembered so that the other records a refusal
applies to are rejected without closing the channel again (for ``refusal_ttl`` seconds).

A refusal is remembered by what it applies to: the exchange (403/404), the ``user_id``
(406) or the body size limit (406, ``max_message_size``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mqdedup.outbox.publishers import OutboxRecord

#: Reply codes of a channel the broker closed because of one publish.
RECORD_REPLY_CODES = frozenset({403, 404, 406})
MAX_SIZE = re.compile(r"larger than configured max size (\d+)")


@dataclass
class Refusals:
    """What the broker refused lately (record properties -> reason, with expiry)."""

    ttl: float
    exchanges: dict[str, tuple[str, float]] = field(default_factory=dict)
    user_ids: dict[str, tuple[str, float]] = field(default_factory=dict)
    size: tuple[int, str, float] | None = None  # bodies of at least this size are refused

    def __bool__(self) -> bool:
        """True while any refusal is remembered (expired ones included)."""
        return bool(self.exchanges or self.user_ids or self.size is not None)

    def reason(self, record: OutboxRecord) -> str | None:
        """The remembered refusal that applies to ``record``, if it has not expired."""
        now = time.monotonic()
        found = self.exchanges.get(record.destination)
        if found is not None and found[1] > now:
            return found[0]
        user_id = user_id_of(record)
        found = self.user_ids.get(user_id) if user_id is not None else None
        if found is not None and found[1] > now:
            return found[0]
        if self.size is not None and self.size[2] > now and len(record.payload) >= self.size[0]:
            return self.size[1]
        return None

    def learn(self, record: OutboxRecord, code: int | None, text: str, reason: str) -> None:
        """Remember why the broker closed the channel because of ``record``."""
        expires = time.monotonic() + self.ttl
        if code == 406 and "user_id" in text:
            user_id = user_id_of(record)
            if user_id is not None:
                self.user_ids[user_id] = (reason, expires)
        elif code == 406 and "size" in text:
            match = MAX_SIZE.search(text)
            limit = int(match.group(1)) + 1 if match else len(record.payload)
            self.size = (min(limit, len(record.payload)), reason, expires)
        elif code in (403, 404):
            self.exchanges[record.destination] = (reason, expires)


def user_id_of(record: OutboxRecord) -> str | None:
    """The record's AMQP ``user_id`` property, if it sets one."""
    value = (record.properties or {}).get("user_id")
    return None if value is None else str(value)


def match_culprit(
    records: Sequence[OutboxRecord], inflight: Iterable[int], code: int | None, text: str
) -> int | None:
    """The record in flight (an index of ``records``) that the broker's close text points
    at (the first match), if any."""
    for index in sorted(inflight):
        record = records[index]
        user_id = user_id_of(record)
        size = MAX_SIZE.search(text)
        if code == 406 and user_id is not None and f"'{user_id}'" in text:
            return index
        if code == 406 and size is not None and len(record.payload) > int(size.group(1)):
            return index
        if code in (403, 404) and f"exchange '{record.destination}'" in text:
            return index
    return None
