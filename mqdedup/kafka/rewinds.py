"""Giving deliveries back: a partition is rewound to its first given-back offset.

:func:`request_rewinds` records the rewinds (any thread: the offset tracker is
thread-safe); :func:`seek_rewinds` performs them on the consumer's owner thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from mqdedup.consumers.transport import Delivery
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.records import KafkaToken, partition_key

log = logging.getLogger(__name__)


def request_rewinds(
    tracker: OffsetTracker, deliveries: Iterable[Delivery[KafkaToken]], consumer_name: str
) -> bool:
    """Record the first given-back offset of each partition; True if any was given back.

    A rewind is ignored when the delivery's epoch is over (its partition moved or was
    given back already).
    """
    first: dict[PartitionKey, KafkaToken] = {}
    for delivery in deliveries:
        token = delivery.token
        seen = first.get(token.partition)
        if seen is None or token.offset < seen.offset:
            first[token.partition] = token
    for token in first.values():
        if tracker.request_rewind(token.partition, token.offset, token.epoch):
            log.warning(
                "rewinding partition to an unsettled message",
                extra={
                    "consumer": consumer_name,
                    "partition": f"{token.partition[0]}/{token.partition[1]}",
                    "offset": token.offset,
                },
            )
    return bool(first)


def seek_rewinds(client: Any, tracker: OffsetTracker) -> None:
    """Seek partitions back to their first unsettled delivery (owner thread only).

    ``client`` is the kafka-python consumer, ``None`` once closed (the rewinds are
    dropped then).
    """
    rewinds = tracker.take_rewinds()
    if not rewinds or client is None:
        return
    assigned = {partition_key(tp): tp for tp in client.assignment() or ()}
    for rewind in rewinds:
        topic_partition = assigned.get(rewind.partition)
        if topic_partition is not None:
            client.seek(topic_partition, rewind.offset)
