"""Who leads what in the Kafka cluster (kafka-python's admin client), for the tests."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

FIGURES_PREFIX = "CLUSTER-FIGURES"


def report(name: str, **figures: Any) -> None:
    """Print the measured figures as one line (``pytest -s`` shows them)."""
    print(f"{FIGURES_PREFIX} {name} {json.dumps(figures, sort_keys=True)}", flush=True)


def describe(admin: Any, topic: str) -> list[dict[str, Any]]:
    [described] = admin.describe_topics([topic])
    return list(described["partitions"])


def leaders(admin: Any, topic: str) -> dict[int, int]:
    """Partition -> the node id of its leader."""
    return {p["partition_index"]: p["leader_id"] for p in describe(admin, topic)}


def busiest_leader(admin: Any, topic: str) -> tuple[int, list[int]]:
    """The broker leading most of ``topic``'s partitions, and those partitions."""
    by_broker: dict[int, list[int]] = collections.defaultdict(list)
    for partition, leader in leaders(admin, topic).items():
        by_broker[leader].append(partition)
    broker = max(sorted(by_broker), key=lambda node: len(by_broker[node]))
    return broker, sorted(by_broker[broker])


def _java_string_hash(text: str) -> int:
    data = text.encode("utf-16-be")
    value = 0
    for index in range(0, len(data), 2):  # Java's String.hashCode over UTF-16 code units
        value = (31 * value + int.from_bytes(data[index : index + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def coordinator(admin: Any, group: str) -> int:
    """The node id of ``group``'s coordinator: the leader of its ``__consumer_offsets``
    partition (Kafka's ``abs(group.hashCode()) % partitions``)."""
    partitions = leaders(admin, "__consumer_offsets")
    code = _java_string_hash(group)
    index = 0 if code == -(1 << 31) else abs(code) % len(partitions)
    return partitions[index]


def wait_in_sync(admin: Any, topics: list[str], replicas: int, timeout: float) -> float:
    """Wait until every partition of ``topics`` has ``replicas`` in-sync replicas and a
    leader; the seconds it took."""
    started = time.monotonic()
    while True:
        try:
            lagging = [
                (topic, p["partition_index"])
                for topic in topics
                for p in describe(admin, topic)
                if len(p["isr_nodes"]) < replicas or p["leader_id"] < 0
            ]
        except Exception as error:  # a metadata request to the node that is coming back
            lagging = [("metadata", repr(error))]  # type: ignore[list-item]
        if not lagging:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not in sync after {timeout}s: {lagging[:5]}")
        time.sleep(0.5)
