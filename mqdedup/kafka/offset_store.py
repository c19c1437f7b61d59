"""Kafka offsets stored in the business transaction (``offsets_in_database``).

One row per group and partition in ``<prefix>kafka_offsets``: ``next_offset`` (the next
record to process), ``done_above`` (records above it committed while one below them
was still being retried) and ``owner_epoch``. :class:`OffsetRows` is the
:class:`~mqdedup.consumers.positions.Positions` of a group member:

* **taking ownership** (:meth:`OffsetRows.done`, before the first batch of a partition
  after each assignment): a transaction of its own creates the row if missing, bumps its
  ``owner_epoch`` and reads it. Deliveries below ``next_offset`` (or in ``done_above``)
  are known duplicates, without a claim. When the broker handed out records *after*
  ``next_offset`` (its committed offset is ahead of the database's), the partition seeks
  back to it: the database is the source of truth;
* **writing** (:meth:`OffsetRows.write`, in the batch's transaction, before its commit):
  one ``UPDATE … WHERE owner_epoch = <ours>`` per partition of the batch. A worker whose
  partition was taken over since (a GC pause, a network partition, an expired session:
  a *zombie*) matches no row: :class:`~mqdedup.consumers.positions.PositionFencedError`
  rolls its transaction back with every effect, its batch is given back and its
  position is read again.

The broker's group offsets are still committed after the database commit (settled
deliveries, :mod:`mqdedup.kafka.offset_commits`), so lag tools keep working.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from mqdedup.consumers.positions import PositionFencedError
from mqdedup.db.schema import schema

if TYPE_CHECKING:
    from sqlalchemy import ColumnElement
    from sqlalchemy.orm import Session, sessionmaker

    from mqdedup.consumers.transport import Delivery
    from mqdedup.kafka.offsets import OffsetTracker, PartitionKey

log = logging.getLogger(__name__)


@dataclass
class _Owned:
    """A partition this member owns in the table: its epoch and what is stored."""

    epoch: int
    next_offset: int | None
    done_above: set[int] = field(default_factory=set)
    #: The first batch after taking ownership is still to come (the seek-back check).
    first: bool = True

    def done(self, offset: int) -> bool:
        return (
            self.next_offset is not None and offset < self.next_offset
        ) or offset in self.done_above


class OffsetRows:
    """The stored offsets of one group member (see the module docs); thread-safe.

    ``claims``: whether message ids are claimed as well (the id strategy names a
    producer id, not the record's coordinates).
    """

    def __init__(
        self,
        group_id: str,
        consumer_name: str,
        tracker: OffsetTracker,
        *,
        prefix: str,
        claims: bool,
        fence_hold: float = 10.0,
    ) -> None:
        self.group_id = group_id
        self.fence_hold = fence_hold
        self.consumer_name = consumer_name
        self.tracker = tracker
        self.table = schema(prefix).kafka_offsets
        self.claims = claims
        self._lock = threading.Lock()
        self._owned: dict[PartitionKey, _Owned] = {}
        #: Partitions another owner took, and until when they are not taken back (unless
        #: assigned afresh before): the group tells a member that lost them by then.
        self._fenced: dict[PartitionKey, float] = {}

    # -- assignment (any thread) -----------------------------------------------------------

    def forget(self, keys: Iterable[PartitionKey]) -> None:
        """``keys`` were revoked, lost or assigned afresh: read them again before use."""
        with self._lock:
            for key in keys:
                self._owned.pop(key, None)
                self._fenced.pop(key, None)

    def stored(self, key: PartitionKey) -> int | None:
        """The stored next offset of ``key`` as this member last read or wrote it."""
        with self._lock:
            owned = self._owned.get(key)
            return None if owned is None else owned.next_offset

    # -- Positions -------------------------------------------------------------------------

    def done(
        self, sessions: sessionmaker[Session], deliveries: Sequence[Delivery[Any]]
    ) -> tuple[list[Delivery[Any]], list[Delivery[Any]]]:
        """``(done, again)``: the known duplicates, and the deliveries of partitions that
        seek back to their stored offset (they come again after it)."""
        # Deliveries of an assignment that is over (revoked, lost, given back) are never
        # a reason to take a partition: the new owner's epoch stays.
        pairs = sorted({(d.token.partition, d.token.epoch) for d in deliveries})
        current = {
            pair for pair, ok in zip(pairs, self.tracker.current_epochs(pairs), strict=True) if ok
        }
        with self._lock:
            now = time.monotonic()
            current = {(key, epoch) for key, epoch in current if self._fenced.get(key, 0.0) <= now}
            keys = {key for key, _epoch in current}
            missing = sorted(key for key in keys if key not in self._owned)
        if missing:
            self._take(sessions, missing)
        done: list[Delivery[Any]] = []
        again: list[Delivery[Any]] = []
        rewound: set[PartitionKey] = set()
        with self._lock:
            for delivery in deliveries:
                token = delivery.token
                key = token.partition
                if (key, token.epoch) not in current:
                    # An assignment that is over, or a partition another owner took (the
                    # rebalance telling this member is on its way): not ours to run.
                    again.append(delivery)
                    continue
                owned = self._owned.get(key)
                if owned is None:
                    continue  # forgotten meanwhile: its write is fenced
                if owned.first:
                    owned.first = False
                    stored = owned.next_offset
                    # The broker is ahead of the database: records from ``stored`` on
                    # were never committed with their effects. Seek back to it.
                    if (
                        stored is not None
                        and token.offset > stored
                        and self.tracker.request_rewind(key, stored, token.epoch)
                    ):
                        log.warning(
                            "the broker's committed offset is ahead of the stored one; "
                            "seeking back to the stored offset",
                            extra={
                                "consumer": self.consumer_name,
                                "partition": f"{key[0]}/{key[1]}",
                                "stored": stored,
                                "fetched": token.offset,
                            },
                        )
                        rewound.add(key)
                if key in rewound:
                    again.append(delivery)
                elif owned.done(token.offset):
                    done.append(delivery)
        return done, again

    def write(self, session: Session, deliveries: Sequence[Delivery[Any]]) -> Callable[[], None]:
        """One conditional UPDATE per partition of ``deliveries`` (done in ``session``'s
        transaction); returns what to call once that transaction committed."""
        offsets: dict[PartitionKey, set[int]] = {}
        for delivery in deliveries:
            offsets.setdefault(delivery.token.partition, set()).add(delivery.token.offset)
        table = self.table
        now = datetime.now(UTC)
        updates: list[tuple[_Owned, int | None, set[int]]] = []
        for key, done in sorted(offsets.items()):
            with self._lock:
                owned = self._owned.get(key)
            if owned is None:
                raise PositionFencedError(
                    f"partition {key[0]}/{key[1]} is no longer assigned to this worker"
                )
            committable, above = self.tracker.preview(
                key, done | owned.done_above, owned.next_offset
            )
            next_offset = _highest(committable, owned.next_offset)
            kept = {o for o in (*above, *owned.done_above, *done) if _above(o, next_offset)}
            result = session.execute(
                update(table)
                .where(_key(table, self.group_id, key), table.c.owner_epoch == owned.epoch)
                .values(
                    next_offset=next_offset,
                    done_above=",".join(map(str, sorted(kept))) or None,
                    updated_at=now,
                )
            )
            if result.rowcount == 0:  # type: ignore[attr-defined]
                raise PositionFencedError(
                    f"partition {key[0]}/{key[1]} was taken over by another worker "
                    f"(owner epoch {owned.epoch} is over)"
                )
            updates.append((owned, next_offset, kept))

        def committed() -> None:
            with self._lock:
                for owned, next_offset, kept in updates:
                    owned.next_offset = next_offset
                    owned.done_above = kept

        return committed

    def fenced(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Another owner took these deliveries' partitions: their deliveries go back until
        a rebalance assigns them to this member afresh (:meth:`forget`) or ``fence_hold``
        seconds (the group's session timeout) have passed; then the stored offsets are
        read again. Not at once: a zombie learns within the session timeout that it lost
        them, and the two owners would fence each other in turn meanwhile. Yet after it:
        if the other owner was the zombie, the partition is this member's."""
        keys = {d.token.partition for d in deliveries}
        log.warning(
            "another worker took over partitions of this batch (a late commit was fenced); "
            "the batch is rolled back and given back",
            extra={"consumer": self.consumer_name, "partitions": [f"{t}/{p}" for t, p in keys]},
        )
        with self._lock:
            until = time.monotonic() + self.fence_hold
            for key in keys:
                self._owned.pop(key, None)
                self._fenced[key] = until

    # -- taking ownership --------------------------------------------------------------------

    def _take(self, sessions: sessionmaker[Session], keys: list[PartitionKey]) -> None:
        """Create missing rows, bump their owner epochs, read them: one transaction."""
        try:
            owned = self._take_once(sessions, keys)
        except IntegrityError:  # another member created a row meanwhile
            owned = self._take_once(sessions, keys)
        with self._lock:
            self._owned.update(owned)
        log.info(
            "stored offsets read",
            extra={
                "consumer": self.consumer_name,
                "offsets": {f"{t}/{p}": o.next_offset for (t, p), o in sorted(owned.items())},
            },
        )

    def _take_once(
        self, sessions: sessionmaker[Session], keys: list[PartitionKey]
    ) -> dict[PartitionKey, _Owned]:
        table = self.table
        c = table.c
        where = or_(*(_key(table, self.group_id, key) for key in keys))
        now = datetime.now(UTC)
        with sessions() as session, session.begin():
            existing = {
                (row.topic, row.partition)
                for row in session.execute(select(c.topic, c.partition).where(where))
            }
            missing = [key for key in keys if key not in existing]
            if missing:
                session.execute(
                    insert(table),
                    [
                        {
                            "group_id": self.group_id,
                            "topic": topic,
                            "partition": partition,
                            "next_offset": None,
                            "owner_epoch": 0,
                            "done_above": None,
                            "updated_at": now,
                        }
                        for topic, partition in missing
                    ],
                )
            session.execute(
                update(table).where(where).values(owner_epoch=c.owner_epoch + 1, updated_at=now)
            )
            rows = session.execute(
                select(c.topic, c.partition, c.next_offset, c.owner_epoch, c.done_above).where(
                    where
                )
            )
            return {
                (row.topic, row.partition): _Owned(
                    epoch=row.owner_epoch,
                    next_offset=row.next_offset,
                    done_above={int(o) for o in (row.done_above or "").split(",") if o},
                )
                for row in rows
            }


def _key(table: Any, group_id: str, key: PartitionKey) -> ColumnElement[bool]:
    c = table.c
    return and_(c.group_id == group_id, c.topic == key[0], c.partition == key[1])


def _highest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _above(offset: int, next_offset: int | None) -> bool:
    return next_offset is None or offset >= next_offset


class StoredOffsets:
    """The stored offsets as a replay sees them (:mod:`mqdedup.kafka.replay`): records
    below a partition's stored offset (or in its ``done_above``) are duplicates, read
    once per batch; nothing is owned or written (the group's rows stay the group's)."""

    def __init__(self, group_id: str, *, prefix: str, claims: bool) -> None:
        self.group_id = group_id
        self.table = schema(prefix).kafka_offsets
        self.claims = claims

    def done(
        self, sessions: sessionmaker[Session], deliveries: Sequence[Delivery[Any]]
    ) -> tuple[list[Delivery[Any]], list[Delivery[Any]]]:
        """``(done, [])``: the deliveries below their partitions' stored offsets."""
        keys = sorted({d.token.partition for d in deliveries})
        if not keys:
            return [], []
        c = self.table.c
        where = or_(*(_key(self.table, self.group_id, key) for key in keys))
        with sessions() as session:
            rows = session.execute(
                select(c.topic, c.partition, c.next_offset, c.done_above).where(where)
            ).all()
        stored = {
            (row.topic, row.partition): _Owned(
                epoch=0,
                next_offset=row.next_offset,
                done_above={int(o) for o in (row.done_above or "").split(",") if o},
            )
            for row in rows
        }
        done = [
            d
            for d in deliveries
            if (owned := stored.get(d.token.partition)) is not None and owned.done(d.token.offset)
        ]
        return done, []

    def write(self, session: Session, deliveries: Sequence[Delivery[Any]]) -> Callable[[], None]:
        """Nothing: a replay never moves the group's stored offsets."""
        return _nothing

    def fenced(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Never: nothing is written."""


def _nothing() -> None:
    return None
