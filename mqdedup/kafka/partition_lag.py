"""The lag of a group member's assigned partitions, for its metrics (:class:`PartitionLag`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kafka.errors as kafka_errors

from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.records import partition_key


class PartitionLag:
    """Per-partition lag: high-water mark minus the committed / consumed offset."""

    def __init__(self) -> None:
        #: Committed offsets of assigned partitions nothing was seen of.
        self._idle_committed: dict[PartitionKey, int] = {}

    def measure(self, client: Any, tracker: OffsetTracker) -> dict[str, int]:
        """``topic/partition -> lag`` of ``client``'s assigned partitions."""
        lag: dict[str, int] = {}
        for topic_partition in client.assignment() or ():
            key = partition_key(topic_partition)
            try:
                high_water = client.highwater(topic_partition)
            except kafka_errors.KafkaError:
                continue
            if high_water is None:
                continue
            position = tracker.committed_offset(key)
            if position is None:
                position = tracker.next_offset(key)
            if position is None:  # nothing seen yet (e.g. just assigned, all caught up)
                position = self._untracked_position(client, key, topic_partition)
            if position is None:
                continue
            lag[f"{key[0]}/{key[1]}"] = max(0, int(high_water) - position)
        return lag

    def forget(self, keys: Iterable[PartitionKey]) -> None:
        """Drop what is known of these partitions (they were revoked or assigned anew)."""
        for key in keys:
            self._idle_committed.pop(key, None)

    def _untracked_position(
        self, client: Any, key: PartitionKey, topic_partition: Any
    ) -> int | None:
        """The group's committed offset of a partition this worker has seen nothing of.

        Asked once per assignment (nobody else commits a partition we own) and only for
        partitions with nothing tracked: a worker that joins a caught-up group still
        reports their lag. kafka-python's own fetch position would not do: it can be
        ahead of records already fetched but not yet polled.
        """
        if key in self._idle_committed:
            return self._idle_committed[key]
        try:
            committed = client.committed(topic_partition, timeout_ms=1000)
        except kafka_errors.KafkaError:
            return None
        if committed is None:
            return None  # nothing committed yet: the lag is known once records come
        self._idle_committed[key] = int(committed)
        return int(committed)
