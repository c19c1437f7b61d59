"""A record the broker refuses fails alone; new partitions are consumed (issue 18).

Shared broker: the limits are topic-level configs of fresh topics
(``max.message.bytes``), so no private broker is needed here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy.orm import Session

from mqdedup import Message, Metrics, RetryPolicy, StopToken
from mqdedup.consumers.context import Context
from mqdedup.dedup.dead_letters import DeadLetterTable
from tests.integration.kafka.consumers import TestOrders, make_consumer
from tests.integration.kafka.helpers import row_counts, total_rows
from tests.services import KafkaHelper, Outgoing, TestDatabase, unique_name, wait_for

pytestmark = pytest.mark.integration

#: ``metadata_refresh`` of the new-partitions test (the default is 10 s; a lower value also
#: proves the setting reaches the client, whose own default is 5 minutes) ...
METADATA_REFRESH = 3.0
#: ... and the documented bound for new partitions: ``metadata_refresh`` + a rebalance.
NEW_PARTITIONS_BOUND = METADATA_REFRESH + 10.0


def counting(consumer: type[TestOrders], calls: Counter[str]) -> type[TestOrders]:
    """``consumer`` that counts every run of its handler per message id."""

    class Counting(consumer):  # type: ignore[valid-type,misc]
        def handle(self, message: Message, ctx: Context) -> Any:
            calls[str(message.id)] += 1
            return super().handle(message, ctx)

    return Counting


@contextmanager
def running(consumer: type[TestOrders], db: TestDatabase) -> Iterator[list[Any]]:
    """Run ``consumer`` in a thread; stop it at the end; yields [Metrics | error]."""
    stop = StopToken()
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(consumer().run(db.engine, stop=stop))
        except BaseException as error:
            result.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.request()
        thread.join(60)
    assert not thread.is_alive(), "the worker did not stop"
    assert len(result) == 1 and isinstance(result[0], Metrics), result


def test_an_oversized_dead_letter_is_kept_in_the_database_and_blocks_nothing(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    dead_letter_topic = f"{topic}.DLT"
    kafka_helper.admin.create_topics(
        {dead_letter_topic: {"num_partitions": 2, "configs": {"max.message.bytes": "1000"}}},
        wait_for_metadata=True,
    )
    messages = [Outgoing(f"a-{i}", b"small", partition=0) for i in range(20)]
    messages.append(Outgoing("poison-small", b"tiny poison", partition=0))
    messages += [Outgoing(f"a-{i}", b"small", partition=0) for i in range(20, 40)]
    messages += [Outgoing(f"b-{i}", b"small", partition=1) for i in range(10)]
    messages.append(Outgoing("poison-big", b"x" * 5_000, partition=1))
    messages += [Outgoing(f"b-{i}", b"small", partition=1) for i in range(10, 50)]
    kafka_helper.produce(topic, messages)
    group = unique_name("group")
    calls: Counter[str] = Counter()
    consumer = counting(
        make_consumer(
            topic=topic,
            group=group,
            prefix=db.prefix,
            bootstrap=kafka_helper.bootstrap,
            bulk=False,
            batch_size=20,
            fail_ids=frozenset({"poison-small", "poison-big"}),
            retry_policy=RetryPolicy(max_attempts=2, initial_backoff=0.05, max_backoff=0.1),
        ),
        calls,
    )
    parked_table = DeadLetterTable(db.prefix)

    def parked() -> list[Any]:
        with Session(db.engine) as session:
            return parked_table.list(session)

    with running(consumer, db) as result:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 90, 60, "every good message")
        wait_for(lambda: len(parked()) == 1, 60, "the oversized poison kept in the database")
        wait_for(
            lambda: kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic),
            60,
            "lag 0 on both partitions",
        )
        time.sleep(1.0)  # a handler rerun past max_attempts would show up meanwhile
    metrics = result[0]

    [kept] = parked()
    assert kept.message.id == "poison-big"
    assert kept.message.body == b"x" * 5_000  # the original bytes
    assert (kept.message.source, kept.message.partition) == (topic, 1)
    assert "MessageSizeTooLargeError" in kept.refusal and dead_letter_topic in kept.refusal
    dead_letters = kafka_helper.read_all(dead_letter_topic, expected=1, timeout=10)
    assert [dict(r.headers)["message-id"] for r in dead_letters] == [b"poison-small"]
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == {f"a-{i}" for i in range(40)} | {f"b-{i}" for i in range(50)}
    assert set(counts.values()) == {1}
    assert calls["poison-small"] <= 2 and calls["poison-big"] <= 2  # never past max_attempts
    assert (metrics.dead_lettered, metrics.dead_letters_parked) == (2, 1)
    assert metrics.dead_letter_failures == 1


def test_partitions_added_under_a_steady_worker_are_consumed_within_the_bound(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=3)
    kafka_helper.produce(topic, [Outgoing(f"o-{i}", b"x", partition=i % 3) for i in range(300)])
    group = unique_name("group")
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        metadata_refresh=METADATA_REFRESH,
    )
    with running(consumer, db):
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 300, 60, "the first partitions")
        kafka_helper.admin.create_partitions({topic: 6})
        grown = time.monotonic()
        wait_for(lambda: len(kafka_helper.end_offsets(topic)) == 6, 30, "six partitions")
        kafka_helper.producer.close(timeout=5)  # its metadata knows only three partitions
        kafka_helper._producer = None
        kafka_helper.produce(
            topic, [Outgoing(f"n-{i}", b"x", partition=3 + i % 3) for i in range(300)]
        )
        wait_for(
            lambda: total_rows(db.engine, db.prefix) >= 600,
            NEW_PARTITIONS_BOUND + 10,
            "the new partitions",
        )
        took = time.monotonic() - grown
    print(f"new partitions consumed {took:.1f} s after the increase")
    assert took < NEW_PARTITIONS_BOUND, f"new partitions consumed after {took:.1f} s"
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 600 and set(counts.values()) == {1}


def test_an_illegal_dead_letter_topic_name_is_a_refusal_kept_in_the_database(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    ids = ["m0", "m1", "poison", "m3", "m4"]
    kafka_helper.produce(topic, [Outgoing(mid, mid.encode()) for mid in ids])
    group = unique_name("group")
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        fail_ids=frozenset({"poison"}),
        dead_letter_topic="not a topic!",
        create_dead_letter_topics=False,
    )
    with running(consumer, db) as result:
        wait_for(
            lambda: kafka_helper.committed(group, topic) == {0: 5}, 60, "the offset past the poison"
        )
    with Session(db.engine) as session:
        [kept] = DeadLetterTable(db.prefix).list(session)
    assert kept.message.id == "poison" and "not a topic!" in kept.refusal
    assert row_counts(db.engine, db.prefix) == {mid: 1 for mid in ids if mid != "poison"}
    assert result[0].dead_letters_parked == 1


class _FutureWithoutInternals:
    """A kafka-python record future as another kafka-python may have it: no
    ``_produce_future`` (the internal that tells an aborted batch from a refused one)."""

    def __init__(self, future: Any) -> None:
        self.future = future

    @property
    def is_done(self) -> bool:
        return bool(self.future.is_done)

    @property
    def exception(self) -> Any:
        return self.future.exception

    def succeeded(self) -> bool:
        return bool(self.future.succeeded())

    def get(self, timeout: float | None = None) -> Any:
        return self.future.get(timeout=timeout)


class _ProducerWithoutInternals:
    def __init__(self, **config: Any) -> None:
        import kafka

        self.producer = kafka.KafkaProducer(**config)

    def send(self, *args: Any, **kwargs: Any) -> _FutureWithoutInternals:
        return _FutureWithoutInternals(self.producer.send(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.producer, name)


@pytest.mark.parametrize("internals", ["kafka-python's", "missing (public fallback)"])
def test_a_refused_record_fails_alone_with_or_without_kafka_pythons_internals(
    kafka_helper: KafkaHelper, internals: str
) -> None:
    """One record above the topic's ``max.message.bytes`` among 300: it alone is refused,
    every other record is on the topic, whether the producer can read kafka-python's
    abort marker or has to send its suspects one by one."""
    from datetime import UTC, datetime

    from mqdedup.kafka import KafkaPublisher
    from mqdedup.outbox.publishers import OutboxRecord, PublishOutcome

    topic = kafka_helper.create_topic(partitions=3, config={"max.message.bytes": "512000"})
    publisher = KafkaPublisher(
        kafka_helper.bootstrap, producer_config={"max_request_size": 4_000_000}
    )
    if internals != "kafka-python's":
        publisher._producer.factory = _ProducerWithoutInternals
    now = datetime.now(UTC)
    big = 150
    rows = [
        OutboxRecord(
            n,
            f"m{n}",
            "kafka",
            topic,
            None,
            f"k{n % 7}".encode(),
            {"message-id": f"m{n}"},
            None,
            b"x" * (1_000_000 if n == big else 100),
            0,
            now,
        )
        for n in range(300)
    ]
    try:
        results = publisher.publish_batch(rows)
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [
        PublishOutcome.REJECTED if n == big else PublishOutcome.PUBLISHED for n in range(300)
    ]
    assert "MessageSizeTooLargeError" in str(results[big].error)
    on_topic = {
        dict(record.headers)["message-id"].decode() for record in kafka_helper.read_all(topic, 299)
    }
    # (an aborted record sent again may be there twice: same message id, deduplicated)
    assert on_topic == {f"m{n}" for n in range(300) if n != big}
