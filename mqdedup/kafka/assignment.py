"""A group member's partition assignment across rebalances (:class:`Assignment`).

Keeps the offset tracker in step with kafka-python's assignment: partitions that really
went to another member are dropped, those kept across a rebalance carry on, fresh ones
get a new epoch and wait for the previous owner's clean-stop check. Called from
kafka-python's IO thread (the rebalance listener) and the owner thread (poll), under one
lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mqdedup.kafka.offsets import OffsetTracker, PartitionKey


class Assignment:
    """The partitions being revoked and those whose previous owner is not checked yet.

    ``assigned_keys`` reads kafka-python's current assignment.
    """

    def __init__(
        self, tracker: OffsetTracker, assigned_keys: Callable[[], set[PartitionKey]]
    ) -> None:
        self.tracker = tracker
        self._assigned_keys = assigned_keys
        self._lock = threading.Lock()
        self._revoking: set[PartitionKey] = set()
        #: Freshly assigned partitions whose previous owner's stop is not checked yet.
        self._unchecked: set[PartitionKey] = set()

    def unchecked(self, key: PartitionKey) -> bool:
        """True while ``key``'s previous owner's stop is not checked yet."""
        return key in self._unchecked

    def checked(self, key: PartitionKey) -> None:
        """``key``'s previous owner's stop is being checked (once per assignment)."""
        with self._lock:
            self._unchecked.discard(key)

    def drop_unassigned(self) -> None:
        """Forget partitions kafka-python no longer assigns (their work is dropped)."""
        with self._lock:
            assigned = self._assigned_keys()
            gone = [key for key in self.tracker.partitions if key not in assigned]
            if gone:
                self.tracker.revoke(gone)
                self._revoking.difference_update(gone)

    def revoking(self, keys: list[PartitionKey]) -> None:
        """``keys`` were revoked; whether they are dropped waits for the assignment."""
        with self._lock:
            self._revoking.update(keys)

    def assigned(self, keys: list[PartitionKey]) -> tuple[list[PartitionKey], ...]:
        """Drop partitions really gone, start fresh ones afresh; ``(gone, fresh, kept)``.

        ``keys`` is the whole new assignment (eager) or the added partitions
        (cooperative). A partition kept from the previous assignment keeps its state in
        kafka-python and here; any other assigned partition has a fresh fetch state
        (it starts at the committed offset), so it gets a new epoch.
        """
        with self._lock:
            assigned = self._assigned_keys() | set(keys)
            revoking, self._revoking = self._revoking, set()
            gone = sorted(revoking - assigned)
            self.tracker.revoke(gone)
            tracked = set(self.tracker.partitions)
            fresh = sorted((set(keys) - revoking) | (assigned - tracked))
            self.tracker.assign(fresh)
            self._unchecked.difference_update(gone)
            self._unchecked.update(fresh)
        kept = sorted(assigned - set(fresh))
        return gone, fresh, kept

    def lost(self, keys: list[PartitionKey]) -> None:
        """Membership expired: drop ``keys``' work; nothing may be committed any more."""
        with self._lock:
            self.tracker.revoke(keys)
            self._revoking.difference_update(keys)
