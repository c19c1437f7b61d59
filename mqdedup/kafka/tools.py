"""Plain kafka-python clients for the test kit's harnesses (:mod:`mqdedup.testing.brokers`).

Topics, raw records in and out, a group's committed offsets: what a test needs to drive
a real broker around a consumer. Here so that the test kit never imports kafka-python.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import kafka
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.structs import TopicPartition

#: A record read back: its value and its headers.
RawRecord = tuple[bytes, dict[str, bytes]]


def admin_client(bootstrap: str) -> Any:
    """A ``KafkaAdminClient`` (create / list / delete topics)."""
    return kafka.KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)


#: Kafka's default ``group.min.session.timeout.ms``.
DEFAULT_MIN_SESSION_TIMEOUT_MS = 6000


def min_session_timeout_ms(admin: Any) -> int:
    """The broker's ``group.min.session.timeout.ms`` (Kafka's default if unreadable).

    Consumers asking for a shorter ``session_timeout_ms`` are refused by the broker.
    """
    name = "group.min.session.timeout.ms"
    try:
        broker = str(admin.describe_cluster()["brokers"][0]["broker_id"])
        resource = ConfigResource(ConfigResourceType.BROKER, broker, configs=[name])
        answer = admin.describe_configs([resource], config_filter="all")
        return int(answer["broker"][broker][name]["value"])
    except Exception:  # an old broker or no DescribeConfigs right: assume the default
        return DEFAULT_MIN_SESSION_TIMEOUT_MS


def producer(bootstrap: str) -> Any:
    """A ``KafkaProducer`` that waits for every in-sync replica (``acks=all``)."""
    return kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all")


def group_offsets(bootstrap: str, group: str, topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """``(committed, end)`` offsets per partition of ``topic`` for ``group``.

    The client never subscribes, so it does not join (or rebalance) the group.
    """
    client = kafka.KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    try:
        partitions = [
            TopicPartition(topic, p) for p in sorted(client.partitions_for_topic(topic) or ())
        ]
        ends = {tp.partition: offset for tp, offset in client.end_offsets(partitions).items()}
        committed = {tp.partition: client.committed(tp) or 0 for tp in partitions}
        return committed, ends
    finally:
        client.close()


def read_topic(
    bootstrap: str,
    topic: str,
    *,
    at_least: int,
    timeout: float,
    wait_for: Callable[[Callable[[], bool], float, str], None],
) -> list[RawRecord]:
    """Every record of ``topic`` from the beginning (``at_least`` of them, then a quiet second).

    ``wait_for(condition, timeout, what)`` waits for the topic to exist.
    """
    client = kafka.KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        wait_for(lambda: bool(client.partitions_for_topic(topic)), timeout, f"topic {topic}")
        partitions = [TopicPartition(topic, p) for p in client.partitions_for_topic(topic)]
        client.assign(partitions)
        client.seek_to_beginning(*partitions)
        records: list[Any] = []
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline and (len(records) < at_least or quiet < 2):
            batch = [r for rs in client.poll(timeout_ms=500).values() for r in rs]
            records.extend(batch)
            quiet = 0 if batch else quiet + 1
    finally:
        client.close()
    return [(r.value, dict(r.headers or ())) for r in records]
