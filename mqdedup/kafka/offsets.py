"""Which Kafka offsets may be committed: contiguous settlement per partition.

Pure bookkeeping, no broker: the Kafka transport tells the tracker what it handed out
(``track_many``), what the processor settled (``settle_many``), what the broker confirmed
(``committed``) and which partitions it gained or lost (``assign`` / ``revoke``).

The committable offset of a partition is the offset *after the last contiguously
settled delivery*: a message still being retried (or one whose dead-letter publish
failed) holds its partition back, even if later messages are already settled. Offsets
are tracked in delivery order, not by arithmetic, so gaps in a partition (compaction,
transaction markers) do not block it.

Every partition has an *epoch* that changes when it is (re)assigned, revoked or
rewound. Deliveries carry the epoch they were handed out in; a settle for an old epoch
is ignored, so work that was in flight when a partition moved never moves its offset.
All methods are thread-safe (the consumer thread tracks and commits while the
processing thread settles).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

#: ``(topic, partition)``
PartitionKey = tuple[str, int]


@dataclass
class _Partition:
    epoch: int
    #: Delivered offsets not yet behind the committable offset, in delivery order.
    pending: deque[int] = field(default_factory=deque)
    #: The same offsets as ``pending``, for O(1) membership tests.
    outstanding: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)
    #: Next offset to commit (after the last contiguously settled delivery).
    committable: int | None = None
    #: Last offset the broker confirmed for this assignment.
    committed: int | None = None
    #: Highest offset handed out in this epoch.
    last_tracked: int | None = None
    #: Records below this offset may have been handed out before (careful mode).
    redelivered_below: int | None = None
    #: Lowest offset rewound to (its delivery could not be settled) in this assignment.
    rewound_to: int | None = None


@dataclass(frozen=True)
class Rewind:
    """A request to seek ``partition`` back to ``offset`` (its first unsettled delivery)."""

    partition: PartitionKey
    offset: int
    epoch: int


class OffsetTracker:
    """Per-partition contiguous-settlement bookkeeping (see the module docs)."""

    def __init__(self, redelivery_window: int = 0) -> None:
        #: After a (re)assignment, the first ``redelivery_window`` records from the
        #: starting offset count as possibly redelivered (see :meth:`track_many`).
        self.redelivery_window = redelivery_window
        self._lock = threading.Lock()
        self._partitions: dict[PartitionKey, _Partition] = {}
        self._epochs = itertools.count(1)
        self._rewinds: dict[PartitionKey, Rewind] = {}

    # -- assignment ----------------------------------------------------------------------

    def assign(self, partitions: Iterable[PartitionKey]) -> None:
        """Start tracking ``partitions`` afresh (new epoch; nothing in flight)."""
        with self._lock:
            for key in partitions:
                self._partitions[key] = _Partition(epoch=next(self._epochs))
                self._rewinds.pop(key, None)

    def revoke(self, partitions: Iterable[PartitionKey]) -> dict[PartitionKey, int]:
        """Stop tracking ``partitions``; return their settled-but-uncommitted offsets.

        The caller may commit the returned offsets (best effort) before the partitions
        go to another owner; deliveries still in flight for them are dropped.
        """
        uncommitted: dict[PartitionKey, int] = {}
        with self._lock:
            for key in partitions:
                state = self._partitions.pop(key, None)
                self._rewinds.pop(key, None)
                if state is not None and _dirty(state):
                    assert state.committable is not None
                    uncommitted[key] = state.committable
        return uncommitted

    @property
    def partitions(self) -> list[PartitionKey]:
        """The partitions currently tracked."""
        with self._lock:
            return sorted(self._partitions)

    # -- the delivery life cycle -----------------------------------------------------------

    def track_many(
        self, key: PartitionKey, offsets: Iterable[int]
    ) -> list[tuple[int, bool] | None]:
        """Record that ``offsets`` of ``key`` are handed out, in order, under one lock.

        For each record: the epoch its delivery carries and whether it may have been
        handed out before, or None when it must be dropped (a rewind of its partition
        is pending, so it will be fetched again after the seek). A partition never
        assigned is assigned on the fly (manual assignment). An offset not above the
        last one handed out means the consumer's position moved back (its fetch state
        was reset): everything after it comes again, so the partition starts a new
        epoch.

        Kafka has no redelivered flag. A record counts as possibly redelivered when it
        is among the first ``redelivery_window`` records from where a fresh assignment
        started (the previous owner may have been handling them when it died), or when
        it is fetched again after a rewind or a reset of the fetch position. The poll
        thread tracks a whole poll per partition at once: one lock per partition, not
        per record (it competes for the lock, and the GIL, with the processing thread).
        """
        tracked: list[tuple[int, bool] | None] = []
        append = tracked.append
        with self._lock:
            for offset in offsets:
                epoch = self._track(key, offset)
                if epoch is None:
                    append(None)
                    continue
                below = self._partitions[key].redelivered_below
                append((epoch, below is not None and offset < below))
        return tracked

    def _track(self, key: PartitionKey, offset: int) -> int | None:
        if key in self._rewinds:
            return None
        state = self._partitions.get(key)
        if state is None:
            state = self._partitions[key] = _Partition(epoch=next(self._epochs))
        elif state.last_tracked is not None and offset <= state.last_tracked:
            state = self._partitions[key] = _Partition(
                epoch=next(self._epochs),
                committed=state.committed,
                redelivered_below=max(state.last_tracked + 1, state.redelivered_below or 0),
            )
        if state.redelivered_below is None:  # the first record of a fresh assignment
            state.redelivered_below = offset + self.redelivery_window
        state.pending.append(offset)
        state.outstanding.add(offset)
        state.last_tracked = offset
        return state.epoch

    def expect_clean(self, key: PartitionKey) -> None:
        """The previous owner of ``key`` stopped cleanly: nothing to mark as redelivered.

        Called before the first record of a fresh assignment is tracked.
        """
        with self._lock:
            state = self._partitions.get(key)
            if state is not None and state.last_tracked is None and state.redelivered_below is None:
                state.redelivered_below = 0

    def clean_offsets(self) -> dict[PartitionKey, int]:
        """At a graceful stop: the offset of each partition whose next owner needs no care.

        That is every partition with a known offset and no unsettled rewound delivery
        below it (a message whose dead letter failed ran its handler: it must come back
        in careful mode).
        """
        with self._lock:
            clean: dict[PartitionKey, int] = {}
            for key, state in self._partitions.items():
                offset = state.committable if state.committable is not None else state.committed
                if offset is None:
                    continue
                if state.rewound_to is not None and offset <= state.rewound_to:
                    continue
                clean[key] = offset
            return clean

    def current_epochs(self, wanted: Iterable[tuple[PartitionKey, int]]) -> list[bool]:
        """For each ``(partition, epoch)`` pair: do deliveries of that epoch still belong
        to this worker? One lock for all."""
        with self._lock:
            partitions = self._partitions
            return [
                (state := partitions.get(key)) is not None and state.epoch == epoch
                for key, epoch in wanted
            ]

    def settle_many(self, settled: Iterable[tuple[PartitionKey, int, int]]) -> int:
        """Mark deliveries settled, given as ``(partition, offset, epoch)`` triples, under
        one lock; return how many were settled. A delivery whose epoch is over (its
        partition moved or was rewound), or settled already, is ignored."""
        count = 0
        with self._lock:
            partitions = self._partitions
            for key, offset, epoch in settled:
                state = partitions.get(key)
                if state is None or state.epoch != epoch:
                    continue
                pending = state.pending
                if not state.settled and pending and pending[0] == offset:
                    # The common case: the partition's next offset, nothing settled out
                    # of order before it: it becomes committable at once.
                    pending.popleft()
                    state.outstanding.discard(offset)
                    state.committable = offset + 1
                    count += 1
                else:
                    count += self._settle(key, offset, epoch)
        return count

    def _settle(self, key: PartitionKey, offset: int, epoch: int) -> bool:
        state = self._partitions.get(key)
        if state is None or state.epoch != epoch:
            return False
        if offset not in state.outstanding or offset in state.settled:
            return False
        state.settled.add(offset)
        while state.pending and state.pending[0] in state.settled:
            done = state.pending.popleft()
            state.outstanding.discard(done)
            state.settled.discard(done)
            state.committable = done + 1
        return True

    def request_rewind(self, key: PartitionKey, offset: int, epoch: int) -> bool:
        """Give up deliveries from ``offset`` on: they must be fetched again.

        Used when a delivery could not be settled (e.g. its dead-letter publish failed):
        the partition gets a new epoch, so later deliveries already handed out are
        dropped, and the consumer thread seeks back to ``offset`` (see
        :meth:`take_rewinds`). Returns False when the epoch is already over.
        """
        with self._lock:
            state = self._partitions.get(key)
            if state is None or state.epoch != epoch:
                return False
            state.epoch = next(self._epochs)
            if state.last_tracked is not None:  # what is fetched again was handed out
                state.redelivered_below = max(state.last_tracked + 1, state.redelivered_below or 0)
            state.rewound_to = offset if state.rewound_to is None else min(offset, state.rewound_to)
            kept = [o for o in state.pending if o < offset]
            state.pending = deque(kept)
            state.outstanding = set(kept)
            state.settled = {o for o in state.settled if o < offset}
            state.last_tracked = kept[-1] if kept else None
            self._rewinds[key] = Rewind(key, offset, state.epoch)
            return True

    def take_rewinds(self) -> list[Rewind]:
        """Seeks the consumer thread still has to do (each returned once)."""
        with self._lock:
            rewinds = [r for r in self._rewinds.values() if self._current(r)]
            self._rewinds.clear()
            return rewinds

    def _current(self, rewind: Rewind) -> bool:
        state = self._partitions.get(rewind.partition)
        return state is not None and state.epoch == rewind.epoch

    # -- commits -------------------------------------------------------------------------

    def to_commit(self) -> dict[PartitionKey, int]:
        """Committable offsets the broker has not confirmed yet."""
        with self._lock:
            return {
                key: state.committable
                for key, state in self._partitions.items()
                if _dirty(state) and state.committable is not None
            }

    def committed(self, offsets: dict[PartitionKey, int]) -> None:
        """Record that the broker confirmed ``offsets``."""
        with self._lock:
            for key, offset in offsets.items():
                state = self._partitions.get(key)
                if state is not None and (state.committed is None or offset > state.committed):
                    state.committed = offset

    def committed_offset(self, key: PartitionKey) -> int | None:
        """The last confirmed commit of ``key`` in this assignment, if any."""
        with self._lock:
            state = self._partitions.get(key)
            return None if state is None else state.committed

    def preview(
        self, key: PartitionKey, done: Collection[int], done_below: int | None = None
    ) -> tuple[int | None, list[int]]:
        """What settling ``done`` (offsets of ``key``), and every offset below
        ``done_below``, as well would make committable.

        Returns the committable offset (None: nothing known) and the offsets of ``done``
        or already settled that would stay above it (a delivery below them unsettled),
        in delivery order. Nothing changes (offsets stored in the database are written
        before the deliveries are settled).
        """
        with self._lock:
            state = self._partitions.get(key)
            if state is None:
                return None, []
            finished = state.settled.union(done)
            committable = state.committable
            above: list[int] = []
            blocked = False
            below = -1 if done_below is None else done_below
            for offset in state.pending:
                if offset >= below and offset not in finished:
                    blocked = True
                elif blocked:
                    above.append(offset)
                else:
                    committable = offset + 1
            return committable, above

    def next_offset(self, key: PartitionKey) -> int | None:
        """The offset after the last delivery handed out for ``key``, if any."""
        with self._lock:
            state = self._partitions.get(key)
            if state is None or state.last_tracked is None:
                return None if state is None else state.committable
            return state.last_tracked + 1


def _dirty(state: _Partition) -> bool:
    return state.committable is not None and (
        state.committed is None or state.committable > state.committed
    )
