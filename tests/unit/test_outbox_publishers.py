"""Publishers without a broker: how the Kafka publisher classifies each record's outcome."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from kafka import errors as kafka_errors

from mqdedup.errors import ConfigurationError
from mqdedup.kafka import KafkaPublisher
from mqdedup.outbox.publishers import OutboxRecord, PublishOutcome


def record(number: int, topic: str = "t", payload: bytes = b"x") -> OutboxRecord:
    return OutboxRecord(
        id=number,
        message_id=f"m{number}",
        broker="kafka",
        destination=topic,
        routing_key=None,
        key=b"k",
        headers={"message-id": f"m{number}", "n": number},
        properties=None,
        payload=payload,
        attempts=0,
        created_at=datetime.now(UTC),
    )


class FakeBatch:
    """kafka-python's per-batch future: ``value[0]`` is ``None`` when the broker answered
    the batch with an error and ``-1`` when the batch was aborted (the producer went
    fatal because of another record)."""

    def __init__(self, base_offset: int | None) -> None:
        self.is_done = True
        self.value = (base_offset, None, None)


class FakeFuture:
    def __init__(
        self, error: BaseException | None = None, done: bool = True, aborted: bool | None = None
    ) -> None:
        self.is_done = done
        self.exception = error
        if aborted is not None:
            self._produce_future = FakeBatch(-1 if aborted else None)

    def succeeded(self) -> bool:
        return self.is_done and self.exception is None

    def get(self, timeout: float | None = None) -> None:
        if not self.is_done:
            raise kafka_errors.KafkaTimeoutError("Timeout after waiting")


class FakeProducer:
    """Records sends; ``plan`` maps a payload to what send() does with it."""

    def __init__(self, plan: dict[bytes, Any]) -> None:
        self.plan = plan
        self.sent: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []
        self.closed = False

    def send(self, topic: str, value: bytes, key: bytes, headers: Any) -> FakeFuture:
        outcome = self.plan.get(value)
        if isinstance(outcome, BaseException):
            raise outcome
        self.sent.append((topic, value, headers))
        return outcome if isinstance(outcome, FakeFuture) else FakeFuture()

    def flush(self, timeout: float | None = None) -> None:
        if self.plan.get(b"flush-timeout"):
            raise kafka_errors.KafkaTimeoutError("Timeout waiting for future")

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


def publisher_with(*plans: dict[bytes, Any]) -> tuple[KafkaPublisher, list[FakeProducer]]:
    """A publisher whose n-th producer (after n-1 replacements) follows ``plans[n]``
    (the last plan for any later one)."""
    publisher = KafkaPublisher("127.0.0.1:1")
    made: list[FakeProducer] = []

    def factory(**_config: Any) -> FakeProducer:
        made.append(FakeProducer(plans[min(len(made), len(plans) - 1)] if plans else {}))
        return made[-1]

    publisher._producer.factory = factory
    publisher.topic_exists = lambda topic: None  # "the cluster did not answer"
    return publisher, made


def test_retriable_broker_errors_and_missing_acks_are_unavailable_not_refused() -> None:
    publisher, _ = publisher_with(
        {
            b"leader": FakeFuture(kafka_errors.NotLeaderForPartitionError()),
            b"pending": FakeFuture(done=False),
        }
    )
    results = publisher.publish_batch([record(1, payload=b"leader"), record(2, payload=b"pending")])
    assert [r.outcome for r in results] == [PublishOutcome.UNAVAILABLE, PublishOutcome.UNAVAILABLE]


def test_metadata_timeout_is_unavailable_until_the_cluster_has_answered() -> None:
    timeout = kafka_errors.KafkaTimeoutError("Failed to update metadata after 10.0 secs.")
    publisher, _ = publisher_with({b"lost": timeout})
    [first] = publisher.publish_batch([record(1, topic="missing", payload=b"lost")])
    assert first.outcome is PublishOutcome.UNAVAILABLE  # nothing proves the cluster is up

    publisher._last_ack = time.monotonic()  # other records were acknowledged just now
    results = publisher.publish_batch(
        [record(2, topic="missing", payload=b"lost"), record(3, topic="missing")]
    )
    assert [r.outcome for r in results] == [PublishOutcome.REJECTED, PublishOutcome.REJECTED]
    assert "unknown or unavailable topic 'missing'" in str(results[0].error)


def test_a_producer_in_a_fatal_state_is_replaced_and_the_record_sent_again() -> None:
    fenced = FakeFuture(kafka_errors.OutOfOrderSequenceNumberError())
    publisher, made = publisher_with({b"x": fenced}, {})
    [result] = publisher.publish_batch([record(1)])
    assert result.outcome is PublishOutcome.PUBLISHED  # on the fresh producer
    assert len(made) == 2 and made[0].closed and not made[1].closed
    assert publisher.replacements == 1


def test_a_refused_record_fails_alone_its_aborted_batch_mates_are_sent_again() -> None:
    """kafka-python aborts every batch in flight with the refused record's error."""
    too_large = kafka_errors.MessageSizeTooLargeError(None)
    first = {
        b"a": FakeFuture(too_large, aborted=True),
        b"big": FakeFuture(too_large, aborted=False),
        b"b": FakeFuture(too_large, aborted=True),
    }
    second = {b"big": FakeFuture(too_large, aborted=False)}
    publisher, made = publisher_with(first, second)
    batch = [record(1, payload=b"a"), record(2, payload=b"big"), record(3, payload=b"b")]
    results = publisher.publish_batch(batch)
    assert [r.outcome for r in results] == [
        PublishOutcome.PUBLISHED,
        PublishOutcome.REJECTED,
        PublishOutcome.PUBLISHED,
    ]
    assert "MessageSizeTooLargeError" in str(results[1].error)
    assert [value for _, value, _ in made[1].sent] == [b"a", b"b"]  # not the refused one
    assert made[0].closed


def test_without_the_abort_marker_suspects_are_sent_one_by_one() -> None:
    """If kafka-python's internals change, a refusal is only believed for a lone record."""
    too_large = kafka_errors.MessageSizeTooLargeError(None)
    everything_fails = {b"a": FakeFuture(too_large), b"big": FakeFuture(too_large)}
    alone = {b"big": FakeFuture(too_large)}
    publisher, _ = publisher_with(everything_fails, alone)
    results = publisher.publish_batch([record(1, payload=b"a"), record(2, payload=b"big")])
    assert [r.outcome for r in results] == [PublishOutcome.PUBLISHED, PublishOutcome.REJECTED]


def test_empty_bootstrap_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="bootstrap servers are empty"):
        KafkaPublisher(" , ")


def test_a_producer_that_may_not_write_at_all_is_an_outage_not_the_records_fault() -> None:
    denied = FakeFuture(kafka_errors.ClusterAuthorizationFailedError())
    publisher, _ = publisher_with({b"x": denied})
    [result] = publisher.publish_batch([record(1)])
    assert result.outcome is PublishOutcome.UNAVAILABLE


def test_a_topic_the_cluster_says_does_not_exist_is_refused_at_once() -> None:
    timeout = kafka_errors.KafkaTimeoutError("Failed to update metadata after 10.0 secs.")
    publisher, _ = publisher_with({b"lost": timeout})
    publisher.topic_exists = lambda topic: topic != "missing"
    [result] = publisher.publish_batch([record(1, topic="missing", payload=b"lost")])
    assert result.outcome is PublishOutcome.REJECTED
    assert "'missing' does not exist" in str(result.error)


def test_the_cluster_is_asked_once_per_missing_topic_and_batch() -> None:
    timeout = kafka_errors.KafkaTimeoutError("Failed to update metadata after 10.0 secs.")
    publisher, _ = publisher_with({b"lost": timeout})
    asked: list[str] = []
    publisher.topic_exists = lambda topic: asked.append(topic) or False
    results = publisher.publish_batch(
        [record(n, topic="missing", payload=b"lost") for n in range(5)]
    )
    assert {r.outcome for r in results} == {PublishOutcome.REJECTED}
    assert asked == ["missing"]
