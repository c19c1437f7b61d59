"""KafkaConsumer configuration, record conversion and dead-letter headers (no broker)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from kafka.consumer.fetcher import ConsumerRecord
from sqlalchemy import Engine

from mqdedup import ConfigurationError, Context, InMemoryBroker, Message, run_until_idle
from mqdedup.consumers.transport import DeadLetter
from mqdedup.kafka import KafkaConsumer
from mqdedup.kafka.records import (
    KafkaToken,
    dead_letter_headers,
    to_message,
)
from tests.support import order_counts, orders


class Orders(KafkaConsumer):
    topics: ClassVar[list[str]] = ["orders"]
    group_id = "billing"

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(orders.insert().values(message_id=message.id))


def consumer_class(**attributes: Any) -> type[Orders]:
    return type("Custom", (Orders,), attributes)


def record(**overrides: Any) -> Any:
    values: dict[str, Any] = {
        "topic": "orders",
        "partition": 2,
        "leader_epoch": 0,
        "offset": 41,
        "timestamp": 1_764_000_000_000,
        "timestamp_type": 0,
        "key": b"k-1",
        "value": b'{"order": 1}',
        "headers": [("message-id", b"id-1"), ("trace", b"abc")],
        "checksum": None,
        "serialized_key_size": 3,
        "serialized_value_size": 12,
        "serialized_header_size": 10,
    }
    values.update(overrides)
    return ConsumerRecord(**values)


# -- configuration ---------------------------------------------------------------------


def test_group_id_is_the_default_dedup_scope() -> None:
    assert Orders().consumer_name == "billing"
    assert consumer_class(name="custom-scope")().consumer_name == "custom-scope"


@pytest.mark.parametrize(
    ("attributes", "problem"),
    [
        ({"topics": []}, "exactly one of topics or topic_pattern"),
        ({"topic_pattern": "orders.*"}, "exactly one of topics or topic_pattern"),
        ({"topics": "orders"}, "must be a list of topic names"),
        ({"topics": [], "topic_pattern": "(unclosed"}, "not a valid regular expression"),
        ({"group_id": None}, "needs a group_id"),
        ({"kafka_config": {"enable_auto_commit": True}}, "must not set enable_auto_commit"),
        ({"kafka_config": {"value_deserializer": str}}, "must not set value_deserializer"),
        ({"kafka_config": {"sasl_mechansim": "PLAIN"}}, "unknown kafka-python consumer"),
        ({"producer_config": {"acks": 1}}, "must keep acks='all'"),
        ({"producer_config": {"lingerms": 1}}, "unknown kafka-python producer"),
        ({"auto_offset_reset": "none"}, "auto_offset_reset"),
        ({"commit_timeout": 0}, "commit_timeout must be positive"),
        (
            {"topics": [], "topic_pattern": "orders.*", "dead_letter_topic": "orders.DLT"},
            "matches its own topic_pattern",
        ),
    ],
)
def test_bad_settings_fail_with_a_one_line_reason(attributes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem) as caught:
        consumer_class(**attributes)().validate()
    assert "\n" not in str(caught.value)
    assert "Custom" in str(caught.value)


def test_bootstrap_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MQDEDUP_KAFKA_BOOTSTRAP", "k1:9092, k2:9093")
    assert Orders().kafka_settings().bootstrap_servers == ("k1:9092", "k2:9093")
    explicit = consumer_class(bootstrap_servers=["x:1"])()
    assert explicit.kafka_settings().bootstrap_servers == ("x:1",)


def test_missing_or_malformed_bootstrap_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MQDEDUP_KAFKA_BOOTSTRAP", raising=False)
    with pytest.raises(ConfigurationError, match="MQDEDUP_KAFKA_BOOTSTRAP"):
        Orders().kafka_settings()
    with pytest.raises(ConfigurationError, match="'localhost' is not host:port"):
        consumer_class(bootstrap_servers="localhost")().kafka_settings()


def test_settings_commit_manually_and_share_security_with_the_producer() -> None:
    secure = consumer_class(
        bootstrap_servers="b:9092",
        kafka_config={
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "PLAIN",
            "sasl_plain_username": "svc",
            "sasl_plain_password": "s3cret",
            "fetch_max_wait_ms": 100,
        },
    )()
    settings = secure.kafka_settings()
    assert settings.consumer_config["enable_auto_commit"] is False
    assert settings.consumer_config["group_id"] == "billing"
    assert settings.consumer_config["auto_offset_reset"] == "earliest"
    assert settings.consumer_config["fetch_max_wait_ms"] == 100
    producer = settings.producer_config
    assert producer["acks"] == "all"
    assert producer["enable_idempotence"] is True
    assert producer["security_protocol"] == "SASL_SSL"
    assert producer["sasl_plain_password"] == "s3cret"
    assert "fetch_max_wait_ms" not in producer
    assert settings.admin_config["sasl_mechanism"] == "PLAIN"
    assert "s3cret" not in repr(settings.bootstrap_servers)


def test_dead_letter_topic_names() -> None:
    settings = consumer_class(bootstrap_servers="b:1")().kafka_settings()
    assert settings.dead_letter_topic_for("orders") == "orders.DLT"
    fixed = consumer_class(bootstrap_servers="b:1", dead_letter_topic="all-failures")()
    assert fixed.kafka_settings().dead_letter_topic_for("orders") == "all-failures"


def test_a_kafka_consumer_runs_on_the_in_memory_broker_without_kafka(
    sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MQDEDUP_KAFKA_BOOTSTRAP", raising=False)
    broker = InMemoryBroker(seed=1)
    for i in range(20):
        broker.publish("orders", b"{}", message_id=f"id-{i % 15}")
    run_until_idle(Orders(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {f"id-{i}": 1 for i in range(15)}


# -- records and dead letters ------------------------------------------------------------


def test_record_becomes_a_message() -> None:
    message = to_message(record())
    assert message.body == b'{"order": 1}'
    assert message.key == b"k-1"
    assert message.header("message-id") == "id-1"
    assert message.coordinates == "orders/2/41"
    assert message.timestamp is not None
    assert message.timestamp.year == 2025


def test_tombstone_and_repeated_headers() -> None:
    message = to_message(record(value=None, headers=[("message-id", b"a"), ("message-id", b"b")]))
    assert message.body == b""
    assert message.header("message-id") == "b"  # the last one wins


def test_dead_letter_headers_keep_the_originals_and_name_the_source() -> None:
    original = record(headers=[("message-id", b"id-1"), ("x-mqdedup-reason", b"old")])
    token = KafkaToken(("orders", 2), 41, 1, original)
    dead = DeadLetter(
        reason="handler failed after 3 attempts: ValueError: bad",
        consumer="billing",
        attempts=3,
        error_class="builtins.ValueError",
        error_message="bad",
    )
    headers = dead_letter_headers(token, dead)
    as_dict = {name: value.decode() for name, value in headers}
    assert headers[0] == ("message-id", b"id-1")
    assert [name for name, _ in headers].count("x-mqdedup-reason") == 1
    assert as_dict["x-mqdedup-reason"].startswith("handler failed after 3 attempts")
    assert as_dict["x-mqdedup-error-class"] == "builtins.ValueError"
    assert as_dict["x-mqdedup-error-message"] == "bad"
    assert as_dict["x-mqdedup-consumer"] == "billing"
    assert as_dict["x-mqdedup-attempts"] == "3"
    assert as_dict["x-mqdedup-source-topic"] == "orders"
    assert as_dict["x-mqdedup-source-partition"] == "2"
    assert as_dict["x-mqdedup-source-offset"] == "41"
    assert as_dict["x-mqdedup-source-timestamp"] == "1764000000000"


def test_unreachable_broker_is_a_one_line_error(sqlite_engine: Engine) -> None:
    from mqdedup.errors import BrokerUnavailableError

    nowhere = consumer_class(bootstrap_servers="127.0.0.1:1", connect_timeout=0.5)()
    with pytest.raises(
        BrokerUnavailableError, match=r"cannot reach Kafka at 127\.0\.0\.1:1"
    ) as caught:
        nowhere.check_connection()
    assert "\n" not in str(caught.value)
    with pytest.raises(BrokerUnavailableError, match="cannot reach Kafka"):
        nowhere.run(sqlite_engine)
