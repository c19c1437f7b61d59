"""Does a Kafka replay range start before the dedup retention horizon?

Claims older than the horizon may have been purged, so replaying messages written
before it could apply them a second time. ``mqdedup replay`` refuses such a range
unless told ``--allow-reprocess``.
"""

from __future__ import annotations

from datetime import datetime

from mqdedup.kafka.replay import KafkaReplay


def partitions_before_horizon(replay: KafkaReplay, horizon: datetime) -> dict[str, tuple[int, int]]:
    """``topic/partition -> (range start, first offset at/after the horizon)`` for every
    partition whose replay range starts with messages older than ``horizon``.

    Opens the replay's range transport (the replay then runs over the same range)."""
    replay.open()
    transport = replay.transport
    starts, ends = transport.starts, transport.ends
    at_horizon = transport.offsets_for_times(list(starts), horizon)
    early: dict[str, tuple[int, int]] = {}
    for key in starts:
        found = at_horizon.get(key)
        first_kept = ends[key] if found is None else int(found)
        if starts[key] < min(first_kept, ends[key]):
            early[f"{key[0]}/{key[1]}"] = (starts[key], first_kept)
    return early
