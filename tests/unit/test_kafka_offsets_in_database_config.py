"""``offsets_in_database``: what the consumer class resolves (no broker needed)."""

from __future__ import annotations

from typing import Any

import pytest

from mqdedup import Context, Message, ids
from mqdedup.dedup.choices import RedisDedup
from mqdedup.errors import ConfigurationError
from mqdedup.kafka import KafkaConsumer


class Orders(KafkaConsumer):
    topics = ("orders",)
    group_id = "billing"
    bootstrap_servers = "localhost:9092"
    offsets_in_database = True

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


def test_off_by_default() -> None:
    assert KafkaConsumer.offsets_in_database is False


def test_claims_only_when_the_id_strategy_names_a_producer_id() -> None:
    assert Orders().kafka_settings().claims_with_offsets  # the message-id header

    class ByCoordinates(Orders):
        message_id_strategy = ids.from_coordinates

    settings = ByCoordinates().kafka_settings()
    assert settings.offsets_in_database and not settings.claims_with_offsets


def test_a_claim_store_outside_the_transaction_is_refused() -> None:
    class InRedis(Orders):
        dedup = RedisDedup()

    with pytest.raises(ConfigurationError, match="offsets_in_database needs the database"):
        InRedis().validate()
