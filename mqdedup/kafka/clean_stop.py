"""The clean-stop marker of offset commits and the previous owner's check.

A graceful stop or hand-over (close, revoke) commits its offsets with
``CLEAN_STOP_METADATA``; the next owner of the partition then need not treat its first
records as possibly redelivered (careful mode). The next owner first commits its start
offset without the marker, so a death from then on leaves a trace.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import kafka.errors as kafka_errors
from kafka.structs import OffsetAndMetadata, TopicPartition

from mqdedup.kafka.offsets import PartitionKey

#: Offset-commit metadata of a graceful stop or hand-over (close, revoke): the next owner
#: of the partition need not treat its first records as possibly redelivered (careful
#: mode). The next owner first commits its start offset without it.
CLEAN_STOP_METADATA = "mqdedup:clean-stop"


def commit_request(
    offsets: Mapping[PartitionKey, int], clean: Collection[PartitionKey] = ()
) -> dict[Any, Any]:
    """kafka-python's commit request: ``clean`` partitions carry ``CLEAN_STOP_METADATA``."""
    return {
        TopicPartition(*key): OffsetAndMetadata(
            offset, CLEAN_STOP_METADATA if key in clean else "", -1
        )
        for key, offset in offsets.items()
    }


def stopped_cleanly(client: Any, topic_partition: Any, timeout: float) -> bool:
    """True when the previous owner of ``topic_partition`` cannot have died on its records.

    That is: its last commit carries ``CLEAN_STOP_METADATA``, or nobody ever committed.
    False when the previous owner may have died on them, or the committed offset cannot
    be read (then the careful window stays).
    """
    try:
        committed = client.committed(topic_partition, metadata=True, timeout_ms=int(timeout * 1000))
    except kafka_errors.KafkaError:
        return False  # unknown: keep the careful window
    return committed is None or committed.metadata == CLEAN_STOP_METADATA
