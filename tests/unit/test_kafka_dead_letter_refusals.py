"""How the Kafka client classifies a failed dead-letter publish (no broker).

A refusal of the record itself is ``DeadLetterRefusedError`` (the processor keeps the
message in the database); everything else is ``BrokerUnavailableError`` (the offset
stays, the message comes back). The real-broker versions of these cases are in
``tests/integration/kafka/test_kafka_refusals.py`` and ``test_kafka_private_broker.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kafka import errors as kafka_errors

from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.kafka.client import KafkaClient
from mqdedup.kafka.records import KafkaToken
from mqdedup.message import Message
from tests.unit.test_kafka_config import consumer_class, record
from tests.unit.test_outbox_publishers import FakeFuture, FakeProducer

REASON = DeadLetter(reason="handler failed after 3 attempts", consumer="billing", attempts=3)


def transport_with(
    *plans: dict[bytes, Any], exists: bool | None = True, create: bool = True
) -> tuple[KafkaClient, list[FakeProducer]]:
    """A transport whose n-th dead-letter producer follows ``plans[n]``."""
    consumer = consumer_class(bootstrap_servers="127.0.0.1:1", create_dead_letter_topics=create)
    transport = KafkaClient(consumer().kafka_settings())
    made: list[FakeProducer] = []

    def factory(**_config: Any) -> FakeProducer:
        made.append(FakeProducer(plans[min(len(made), len(plans) - 1)]))
        return made[-1]

    dead_letters = transport.dead_letters
    dead_letters._producer.factory = factory
    dead_letters._ensure_dead_letter_topic = lambda topic, source: None  # type: ignore[method-assign]
    dead_letters._topic_exists = lambda topic: exists  # type: ignore[method-assign]
    return transport, made


def delivery(value: bytes = b'{"order": 1}') -> Delivery[KafkaToken]:
    kafka_record = record(value=value)
    token = KafkaToken(("orders", 2), 41, 1, kafka_record)
    return Delivery(Message(body=value, source="orders", partition=2, offset=41), token)


def test_a_record_too_large_for_the_topic_is_refused_and_the_producer_replaced() -> None:
    too_large = FakeFuture(kafka_errors.MessageSizeTooLargeError(None), aborted=False)
    transport, made = transport_with({b"big": too_large}, {})
    with pytest.raises(DeadLetterRefusedError, match=r"'orders\.DLT'.*MessageSizeTooLargeError"):
        transport.dead_letter(delivery(b"big"), REASON)
    assert made[0].closed  # kafka-python's producer is fatal after a refusal
    transport.dead_letter(delivery(b"small"), REASON)  # the next one goes through
    assert [value for _, value, _ in made[1].sent] == [b"small"]


def test_an_aborted_dead_letter_is_sent_again_on_a_fresh_producer() -> None:
    aborted = FakeFuture(kafka_errors.MessageSizeTooLargeError(None), aborted=True)
    transport, made = transport_with({b"x": aborted}, {})
    transport.dead_letter(delivery(b"x"), REASON)  # no error: published on the second one
    assert len(made) == 2 and [value for _, value, _ in made[1].sent] == [b"x"]


def test_an_unauthorised_or_invalid_topic_is_refused() -> None:
    denied = FakeFuture(kafka_errors.TopicAuthorizationFailedError(), aborted=False)
    transport, _ = transport_with({b"x": denied})
    with pytest.raises(DeadLetterRefusedError, match="TopicAuthorizationFailedError"):
        transport.dead_letter(delivery(b"x"), REASON)


def test_no_acknowledgement_and_retriable_errors_are_outages() -> None:
    for outcome in (
        FakeFuture(done=False),
        FakeFuture(kafka_errors.NotLeaderForPartitionError(), aborted=False),
        FakeFuture(kafka_errors.ClusterAuthorizationFailedError(), aborted=False),
    ):
        transport, _ = transport_with({b"x": outcome})
        transport.settings = dataclasses.replace(transport.settings, dead_letter_timeout=0.1)
        with pytest.raises(BrokerUnavailableError):
            transport.dead_letter(delivery(b"x"), REASON)


def test_a_missing_topic_is_refused_only_when_the_cluster_says_so() -> None:
    no_metadata = kafka_errors.KafkaTimeoutError("Failed to update metadata after 5.0 secs.")
    transport, _ = transport_with({b"x": no_metadata}, exists=False, create=False)
    with pytest.raises(DeadLetterRefusedError, match=r"does not exist.*create_dead_letter_topics"):
        transport.dead_letter(delivery(b"x"), REASON)
    for exists in (None, True):  # no answer, or it exists after all: an outage
        transport, _ = transport_with({b"x": no_metadata}, exists=exists)
        with pytest.raises(BrokerUnavailableError):
            transport.dead_letter(delivery(b"x"), REASON)


def test_an_unreachable_cluster_is_an_outage() -> None:
    transport, _ = transport_with({})

    def refuse(**_config: Any) -> Any:
        raise kafka_errors.NoBrokersAvailable()

    transport.dead_letters._producer.factory = refuse
    with pytest.raises(BrokerUnavailableError, match="NoBrokersAvailable"):
        transport.dead_letter(delivery(), REASON)
