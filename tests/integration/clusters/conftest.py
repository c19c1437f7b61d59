"""Fixtures of the broker-cluster tests: a three-broker Kafka and a three-node RabbitMQ.

Each cluster is started by ``scripts/services.sh start kafka-cluster`` /
``start rabbitmq-cluster`` when its module starts and STOPPED when the module ends, so the
rest of the suite keeps the machine's CPU. The tests kill and restart single nodes of
these clusters (``services.sh kill kafka-cluster-2``); the shared single-node brokers are
never touched.

They take minutes and most of the machine, so the main suite (``scripts/test.sh``) does
not collect them: ``scripts/test_clusters.sh`` runs them (it sets
``MQDEDUP_TEST_CLUSTERS=1``), after the main suite in CI.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration.clusters.support import Cluster
from tests.integration.outbox.conftest import outbox_db as outbox_tables
from tests.integration.outbox.helpers import OutboxDb

#: Collected only when asked for (scripts/test_clusters.sh).
collect_ignore_glob = [] if os.environ.get("MQDEDUP_TEST_CLUSTERS") == "1" else ["test_*.py"]


@pytest.fixture(scope="module")
def kafka_cluster_module() -> Iterator[Cluster]:
    with Cluster.running("kafka-cluster") as cluster:
        yield cluster


@pytest.fixture
def kafka_cluster(kafka_cluster_module: Cluster) -> Cluster:
    """The three-broker Kafka (RF=3, min.insync.replicas=2), every node up at the test's
    start (a failed test may leave one killed); stopped at the module's end."""
    kafka_cluster_module.start_all()
    return kafka_cluster_module


@pytest.fixture(scope="module")
def rabbitmq_cluster_module() -> Iterator[Cluster]:
    with Cluster.running("rabbitmq-cluster") as cluster:
        yield cluster


@pytest.fixture
def rabbitmq_cluster(rabbitmq_cluster_module: Cluster) -> Cluster:
    """The three-node RabbitMQ cluster, every node up at the test's start; stopped at the
    module's end."""
    rabbitmq_cluster_module.start_all()
    return rabbitmq_cluster_module


@pytest.fixture
def outbox_db(pg_url: str) -> Iterator[OutboxDb]:
    """Fresh framework tables and ``<prefix>events`` in the shared PostgreSQL."""
    with outbox_tables(pg_url) as database:
        yield database
