"""Fixtures of the acceptance tests (the shared services' fixtures: ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

from tests.services import KafkaHelper


@pytest.fixture
def kafka(kafka_helper: KafkaHelper) -> KafkaHelper:
    """The shared Kafka; topics this helper created are deleted at the end."""
    return kafka_helper
