"""Does a Kafka replay range start before the dedup retention horizon?

Claims older than the horizon may have been purged, so replaying messages written
before it could apply them a second time. ``mqdedup replay`` refuses such a range
unless told ``--allow-reprocess``.
"""

from __future__ import annotations

from datetime import datetime

from mqdedup.kafka.client import KafkaClient
from mqdedup.kafka.replay import KafkaReplay


def partitions_before_horizon(replay: KafkaReplay, horizon: datetime) -> dict[str, tuple[int, int]]:
    """``topic/partition -> (range start, first offset at/after the horizon)`` for every
    partition whose replay range starts with messages older than ``horizon``."""
    transport = KafkaClient(replay.settings, metrics=replay.metrics, group=False)
    try:
        transport.open()
        keys = replay.partitions_to_replay(transport)
        starts, ends = replay.offset_range(transport, keys)
        at_horizon = transport.offsets_for_times(keys, horizon)
        early: dict[str, tuple[int, int]] = {}
        for key in keys:
            found = at_horizon.get(key)
            first_kept = ends[key] if found is None else int(found)
            if starts[key] < min(first_kept, ends[key]):
                early[f"{key[0]}/{key[1]}"] = (starts[key], first_kept)
        return early
    finally:
        transport.close(commit=False)
