"""The rebalance listener: keeps a :class:`~mqdedup.kafka.client.KafkaClient`'s offset
tracker in step with kafka-python's assignment (through the client's callbacks it is
given), and logs what moved."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import kafka

from mqdedup.kafka.offsets import PartitionKey
from mqdedup.kafka.records import partition_key

log = logging.getLogger(__name__)


class RebalanceListener(kafka.ConsumerRebalanceListener):  # type: ignore[misc]
    """Keeps the offset tracker in step with kafka-python's assignment.

    kafka-python 3 runs these callbacks on its IO thread; they only touch the
    (thread-safe) offset tracker and queue an asynchronous commit.
    """

    def __init__(
        self,
        consumer_name: str,
        *,
        revoked: Callable[[list[PartitionKey]], dict[PartitionKey, int]],
        lost: Callable[[list[PartitionKey]], None],
        assigned: Callable[[list[PartitionKey]], tuple[list[PartitionKey], ...]],
    ) -> None:
        self.consumer_name = consumer_name
        self._revoked = revoked
        self._lost = lost
        self._assigned = assigned

    def on_partitions_revoked(self, revoked: Any) -> None:
        keys = [partition_key(tp) for tp in revoked]
        uncommitted = self._revoked(keys)
        log.info(
            "partitions revoked",
            extra={
                "consumer": self.consumer_name,
                "partitions": _names(keys),
                "committing": {f"{k[0]}/{k[1]}": v for k, v in uncommitted.items()},
            },
        )

    def on_partitions_lost(self, lost: Any) -> None:
        keys = [partition_key(tp) for tp in lost]
        self._lost(keys)
        log.warning(
            "partitions lost (group membership expired); their in-flight work is dropped",
            extra={"consumer": self.consumer_name, "partitions": _names(keys)},
        )

    def on_partitions_assigned(self, assigned: Any) -> None:
        keys = [partition_key(tp) for tp in assigned]
        gone, fresh, kept = self._assigned(keys)
        log.info(
            "partitions assigned",
            extra={
                "consumer": self.consumer_name,
                "partitions": _names(fresh),
                "kept": _names(kept),
                "dropped": _names(gone),
            },
        )


def _names(keys: Iterable[PartitionKey]) -> list[str]:
    return [f"{topic}/{partition}" for topic, partition in sorted(keys)]
