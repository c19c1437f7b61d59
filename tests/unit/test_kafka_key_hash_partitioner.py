"""The relay's Kafka partitioner picks the partitions kafka-python's default one picks."""

from __future__ import annotations

from kafka.partitioner.default import DefaultPartitioner

from mqdedup.kafka.producer import KeyHashPartitioner


class _Cluster:
    def __init__(self, partitions: set[int]) -> None:
        self.partitions = partitions

    def topics(self) -> set[str]:
        return {"orders"}

    def partitions_for_topic(self, _topic: str) -> set[int]:
        return self.partitions

    def available_partitions_for_topic(self, _topic: str) -> set[int]:
        return self.partitions


def test_same_partition_as_the_default_for_every_key_and_partition_count() -> None:
    cached, default = KeyHashPartitioner(max_keys=50), DefaultPartitioner()
    keys = [f"key-{n}".encode() for n in range(200)] + [b"", b"\xff\x00\x01", "ключ".encode()]
    for partitions in ({0}, {0, 1, 2}, set(range(7)), {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}):
        cluster = _Cluster(partitions)
        for _ in range(2):  # computed, then remembered (and forgotten past max_keys)
            for key in keys:
                expected = default.partition("orders", key, key, b"v", b"v", cluster)
                assert cached.partition("orders", key, key, b"v", b"v", cluster) == expected
    assert len(cached._hashes) <= 50


def test_records_without_a_key_still_get_a_partition() -> None:
    cluster = _Cluster({0, 1, 2})
    assert KeyHashPartitioner().partition("orders", None, None, b"v", b"v", cluster) in {0, 1, 2}
