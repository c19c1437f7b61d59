"""The kafka-python settings mqdedup changes so a broker restart and new partitions are
followed within seconds (issue 18); measured on a real broker in
``tests/integration/kafka/test_kafka_private_broker.py`` and ``bench/kafka_recovery_bench.py``."""

from __future__ import annotations

import pytest

from mqdedup import ConfigurationError
from tests.unit.test_kafka_config import consumer_class


def test_every_client_reconnects_within_a_second_and_gives_up_on_a_dead_broker_in_10_s() -> None:
    settings = consumer_class(bootstrap_servers="b:1")().kafka_settings()
    for config in (settings.consumer_config, settings.producer_config, settings.admin_config):
        assert config["reconnect_backoff_max_ms"] == 1000  # kafka-python: up to 30 s
        assert config["request_timeout_ms"] == 10_000  # kafka-python: 30 s
    assert settings.consumer_config["metadata_max_age_ms"] == 10_000  # kafka-python: 5 min
    assert settings.producer_config["max_block_ms"] == 5_000  # a missing DLT shows in 5 s


def test_metadata_refresh_and_kafka_config_override_the_defaults() -> None:
    settings = consumer_class(
        bootstrap_servers="b:1",
        metadata_refresh=2.5,
        kafka_config={"reconnect_backoff_max_ms": 5000},
        producer_config={"max_block_ms": 20_000},
    )().kafka_settings()
    assert settings.consumer_config["metadata_max_age_ms"] == 2_500
    assert settings.consumer_config["reconnect_backoff_max_ms"] == 5000
    assert settings.producer_config["reconnect_backoff_max_ms"] == 5000  # shared setting
    assert settings.producer_config["max_block_ms"] == 20_000


def test_metadata_refresh_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="metadata_refresh must be positive"):
        consumer_class(bootstrap_servers="b:1", metadata_refresh=0)().kafka_settings()
