"""Fixtures shared by the acceptance tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import require_service
from tests.integration.kafka.helpers import KafkaHelper


@pytest.fixture
def kafka() -> Iterator[KafkaHelper]:
    """The shared Kafka; topics this helper created are deleted at the end."""
    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    if not bootstrap:
        require_service("Kafka", "MQDEDUP_KAFKA_BOOTSTRAP is not set")
    assert bootstrap is not None
    try:
        helper = KafkaHelper(bootstrap)
    except Exception as exc:  # any connection failure means "no Kafka"
        require_service("Kafka", str(exc))
    yield helper
    helper.close()
