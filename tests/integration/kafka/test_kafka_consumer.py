"""KafkaConsumer against the real broker and PostgreSQL: dedup, poison messages, DLT."""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import delete, select

from mqdedup import Metrics, StopToken
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import BrokerUnavailableError
from mqdedup.kafka.records import KafkaToken
from mqdedup.kafka.transport import KafkaTransport
from tests.integration.kafka.consumers import TestOrders, make_consumer
from tests.integration.kafka.helpers import row_counts, total_rows
from tests.services import KafkaHelper, Outgoing, TestDatabase, unique_name, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration


@contextmanager
def running(consumer: type[TestOrders], db: TestDatabase) -> Iterator[Metrics]:
    """Run ``consumer`` on a thread (the production loop); stop it gracefully at the end."""
    stop = StopToken()
    metrics = Metrics()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result = consumer().run(db.engine, stop=stop)
            metrics.__dict__.update(result.__dict__)
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=target, name="test-worker", daemon=True)
    thread.start()
    try:
        yield metrics
    finally:
        stop.request()
        thread.join(60)
    assert not thread.is_alive(), "the worker did not stop within 60 s"
    if failure:
        raise failure[0]


def consumer_for(
    kafka_helper: KafkaHelper, db: TestDatabase, topic: str, **attributes: Any
) -> type[TestOrders]:
    return make_consumer(
        topic=topic,
        group=unique_name("group"),
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        **attributes,
    )


def headers_of(record: Any) -> dict[str, str]:
    return {name: value.decode() for name, value in record.headers}


def test_duplicates_on_three_partitions_leave_one_row_per_unique_id(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=3)
    rng = random.Random(3)
    unique = [f"order-{i}" for i in range(14_000)]
    keyed = [
        (float(i), Outgoing(mid, f'{{"n": {i}}}'.encode(), partition=rng.randrange(3)))
        for i, mid in enumerate(unique)
    ]
    # 30% duplicates: the same message-id header again, at later offsets (any partition).
    for index in rng.sample(range(len(unique)), 6_000):
        original = keyed[index][1]
        copy = Outgoing(original.message_id, original.body, partition=rng.randrange(3))
        keyed.append((rng.uniform(index + 0.5, len(unique)), copy))
    outgoing = [message for _, message in sorted(keyed, key=lambda pair: pair[0])]
    assert kafka_helper.produce(topic, outgoing) == 20_000

    consumer = consumer_for(kafka_helper, db, topic, batch_size=500)
    with running(consumer, db) as metrics:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= len(unique), 90, "14,000 rows")
        wait_for(
            lambda: (
                kafka_helper.committed(consumer.group_id or "", topic)
                == kafka_helper.end_offsets(topic)
            ),
            30,
            "offsets committed up to the end",
        )

    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == set(unique)
    assert set(counts.values()) == {1}
    assert metrics.processed == 14_000
    assert metrics.processed + metrics.duplicates >= 20_000


def test_poison_message_is_retried_then_dead_lettered_and_the_partition_moves_on(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    ids = [f"ok-{i}" for i in range(10)]
    ids[4] = "poison-1"
    kafka_helper.produce(
        topic, [Outgoing(mid, f"body-{mid}".encode(), key=f"key-{mid}".encode()) for mid in ids]
    )
    consumer = consumer_for(kafka_helper, db, topic, batch_size=50, fail_ids=["poison-1"])
    group = consumer.group_id or ""

    with running(consumer, db) as metrics:
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 10}, 60, "committed offset 10")

    good = [mid for mid in ids if mid != "poison-1"]
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(good, 1)
    dead = kafka_helper.read_all(f"{topic}.DLT", expected=1)
    assert len(dead) == 1
    record = dead[0]
    assert (record.key, record.value) == (b"key-poison-1", b"body-poison-1")
    headers = headers_of(record)
    assert headers["message-id"] == "poison-1"  # the original headers are kept
    assert (
        headers["x-mqdedup-reason"]
        == "handler failed after 3 attempts: ValueError: cannot handle poison-1"
    )
    assert headers["x-mqdedup-error-class"] == "builtins.ValueError"
    assert headers["x-mqdedup-error-message"] == "cannot handle poison-1"
    assert headers["x-mqdedup-consumer"] == group
    assert headers["x-mqdedup-attempts"] == "3"
    assert headers["x-mqdedup-source-topic"] == topic
    assert headers["x-mqdedup-source-partition"] == "0"
    assert headers["x-mqdedup-source-offset"] == "4"
    store = DedupStore(db.prefix)
    with db.engine.connect() as connection:
        attempts = connection.execute(
            select(store.schema.attempts.c.attempts).where(
                store.schema.attempts.c.message_id == "poison-1"
            )
        ).scalar_one()
    assert attempts == 3
    assert metrics.dead_lettered == 1
    assert metrics.retries == 2


def test_message_without_id_header_is_dead_lettered_with_the_reason(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    kafka_helper.produce(
        topic,
        [
            Outgoing("a", b"1"),
            Outgoing("b", b"2"),
            Outgoing(None, b"no id here"),
            Outgoing("c", b"3"),
        ],
    )
    consumer = consumer_for(kafka_helper, db, topic)
    with running(consumer, db):
        wait_for(
            lambda: kafka_helper.committed(consumer.group_id or "", topic) == {0: 4}, 60, "offset 4"
        )

    assert row_counts(db.engine, db.prefix) == {"a": 1, "b": 1, "c": 1}
    dead = kafka_helper.read_all(f"{topic}.DLT", expected=1)
    assert [r.value for r in dead] == [b"no id here"]
    headers = headers_of(dead[0])
    assert headers["x-mqdedup-reason"].startswith("missing message id")
    assert "message-id" in headers["x-mqdedup-reason"]
    assert headers["x-mqdedup-source-offset"] == "2"


def test_failed_dead_letter_publish_keeps_the_offset_before_the_message(
    kafka_helper: KafkaHelper, db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    ids = ["m0", "m1", "m2", "poison", "m4", "m5", "m6"]
    kafka_helper.produce(topic, [Outgoing(mid, mid.encode()) for mid in ids])
    # The dead-letter producer cannot reach any broker: every dead-letter publish fails
    # as an outage (a refusal, such as an illegal topic name, is kept in the database).
    consumer = consumer_for(
        kafka_helper,
        db,
        topic,
        fail_ids=["poison"],
        producer_config={"bootstrap_servers": ["127.0.0.1:1"], "bootstrap_timeout_ms": 300},
    )
    group = consumer.group_id or ""
    with running(consumer, db) as metrics:
        wait_for(lambda: total_rows(db.engine, db.prefix) == 6, 60, "the six good rows")
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 3}, 30, "offset 3 committed")
        # The poison message is fetched and its dead letter tried again (after a
        # back-off), its handler never past max_attempts (careful mode) ...
        wait_for(
            lambda: failed_dead_letters(caplog) >= 4, 60, "more dead-letter tries of the poison"
        )
        assert metrics_of(db, "poison") == 3
        # ... and the offset never passes it.
        assert kafka_helper.committed(group, topic) == {0: 3}

    assert kafka_helper.committed(group, topic) == {0: 3}
    assert row_counts(db.engine, db.prefix) == {mid: 1 for mid in ids if mid != "poison"}
    assert metrics.dead_lettered == 0


def test_a_batch_left_unsettled_is_given_back_fetched_again_and_processed_once(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    """The poison's first two dead-letter publishes fail (an outage, forced here): the
    batch leaves it unsettled, the Worker gives it back, the partition seeks back to it
    (what followed it comes again too) and, once the publish works, it is dead-lettered
    once and the offset moves past it. No effect is doubled."""
    topic = kafka_helper.create_topic(partitions=1)
    ids = ["m0", "m1", "poison", "m3", "m4"]
    kafka_helper.produce(topic, [Outgoing(mid, mid.encode()) for mid in ids])
    base = consumer_for(kafka_helper, db, topic, batch_size=50, fail_ids=["poison"])
    outages = [BrokerUnavailableError("the dead-letter topic is unreachable (test)")] * 2
    fetched: Counter[str] = Counter()

    class FlakyDeadLetters(base):  # type: ignore[valid-type, misc]
        def create_transport(
            self, *, stop: StopToken | None = None, metrics: Metrics | None = None
        ) -> KafkaTransport:
            transport: KafkaTransport = super().create_transport(stop=stop, metrics=metrics)
            fetch, publish = transport.fetch, transport.dead_letter

            def counting_fetch(max_messages: int, timeout: float) -> list[Delivery[KafkaToken]]:
                batch = fetch(max_messages, timeout)
                fetched.update(str(d.message.header("message-id")) for d in batch)
                return batch

            def flaky_dead_letter(delivery: Delivery[KafkaToken], record: DeadLetter) -> None:
                if outages:
                    raise outages.pop()
                publish(delivery, record)

            transport.fetch = counting_fetch  # type: ignore[method-assign]
            transport.dead_letter = flaky_dead_letter  # type: ignore[method-assign]
            return transport

    group = base.group_id or ""
    with running(FlakyDeadLetters, db) as metrics:
        wait_for(lambda: kafka_helper.committed(group, topic) == {0: 5}, 60, "offset 5 committed")

    assert fetched["poison"] == 3, "fetched again after each give-back"
    assert fetched["m3"] >= 2, "the partition was rewound to the poison"
    assert row_counts(db.engine, db.prefix) == {mid: 1 for mid in ids if mid != "poison"}
    dead = kafka_helper.read_all(f"{topic}.DLT", expected=1)
    assert [headers_of(record)["message-id"] for record in dead] == ["poison"]
    assert metrics.dead_lettered == 1
    assert metrics_of(db, "poison") == 3  # its handler never ran past max_attempts


def failed_dead_letters(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in list(caplog.records) if r.getMessage().startswith("dead-letter failed"))


def metrics_of(db: TestDatabase, message_id: str) -> int:
    table = DedupStore(db.prefix).schema.attempts
    with db.engine.connect() as connection:
        found = connection.execute(
            select(table.c.attempts).where(table.c.message_id == message_id)
        ).scalar()
    return int(found or 0)


def test_long_batches_do_not_cost_the_group_membership(
    kafka_helper: KafkaHelper, db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    ids = [f"slow-{i}" for i in range(8)]
    kafka_helper.produce(topic, [Outgoing(mid, b"x", partition=i % 2) for i, mid in enumerate(ids)])
    # Two batches of 2.5 s each, longer than max_poll_interval_ms: without polling on the
    # side the worker would be evicted from the group and the messages delivered again.
    consumer = consumer_for(
        kafka_helper,
        db,
        topic,
        batch_size=4,
        delay=2.5,
        prefetch_batches=1,
        kafka_config={"max_poll_interval_ms": 1500, "max_poll_records": 4},
    )
    caplog.set_level(logging.INFO)
    with running(consumer, db) as metrics:
        wait_for(
            lambda: (
                kafka_helper.committed(consumer.group_id or "", topic)
                == kafka_helper.end_offsets(topic)
            ),
            60,
            "everything committed",
        )
        messages = [r.getMessage() for r in caplog.records]

    assert not [m for m in messages if "poll timeout has expired" in m]
    assert not [m for m in messages if "partitions lost" in m]
    assert metrics.delivered == len(ids)  # nothing was delivered twice
    assert row_counts(db.engine, db.prefix) == dict.fromkeys(ids, 1)


def test_replay_counts_duplicates_and_reapplies_only_what_was_forgotten(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    first = [Outgoing(f"r-{i}", b"first", partition=i % 2) for i in range(40)]
    kafka_helper.produce(topic, first)
    middle = datetime.now(UTC) + timedelta(milliseconds=20)
    wait_for(lambda: datetime.now(UTC) > middle, 5, "the clock to pass the middle", interval=0.005)
    second = [Outgoing(f"r-{i}", b"second", partition=i % 2) for i in range(40, 60)]
    kafka_helper.produce(topic, [*second, Outgoing(None, b"no id", partition=0)])
    consumer = consumer_for(kafka_helper, db, topic)
    group = consumer.group_id or ""
    with running(consumer, db):
        wait_for(
            lambda: kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic),
            60,
            "all committed",
        )
    committed_before = kafka_helper.committed(group, topic)

    everything = consumer().replay(db.engine, dry_run=True)
    assert (everything.new, everything.duplicates, everything.without_id) == (0, 60, 1)

    since = consumer().replay(db.engine, start=middle, dry_run=True)
    assert (since.new, since.duplicates, since.without_id) == (0, 20, 1)

    only_p1 = consumer().replay(db.engine, partitions=[1], end=10, dry_run=True)
    assert only_p1.duplicates == 10
    assert only_p1.ranges == {f"{topic}/1": (0, 10)}

    # Forget five messages (claims and rows), as if restored from an old backup.
    forgotten = [f"r-{i}" for i in range(5)]
    store = DedupStore(db.prefix)
    with db.engine.begin() as connection:
        connection.execute(
            delete(store.schema.processed).where(store.schema.processed.c.message_id.in_(forgotten))
        )
        orders = orders_table(db.prefix)
        connection.execute(delete(orders).where(orders.c.message_id.in_(forgotten)))

    assert consumer().replay(db.engine, dry_run=True).new == 5
    applied = consumer().replay(db.engine)
    assert (applied.new, applied.duplicates) == (5, 55)
    assert row_counts(db.engine, db.prefix) == {f"r-{i}": 1 for i in range(60)}
    # The replay never touched the group's offsets.
    assert kafka_helper.committed(group, topic) == committed_before


def test_a_group_join_lost_by_kafka_python_is_started_again(
    kafka_helper: KafkaHelper, db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kafka-python 3.0 can lose a completed JoinGroup/SyncGroup when the poll that
    started it timed out first (here forced with 1 ms polls): without the watchdog the
    worker stays in the group with no partitions and never consumes anything (still so
    with kafka-python 3.0.12: nothing consumed within 30 s in 3 of 3 runs). The watchdog
    leaves the group and subscribes again (public API)."""
    from mqdedup.kafka import group_join as kafka_group_join
    from mqdedup.kafka import transport as kafka_transport

    monkeypatch.setattr(kafka_group_join, "REBALANCE_POLL", 0.0)
    monkeypatch.setattr(kafka_group_join, "REJOIN_AFTER", 2.0)
    monkeypatch.setattr(kafka_transport, "POLL_SLICE", 0.001)
    for attempt in range(3):
        topic = kafka_helper.create_topic(partitions=2)  # new topic: metadata arrives late
        ids = [f"j{attempt}-{i}" for i in range(20)]
        kafka_helper.produce(
            topic, [Outgoing(mid, b"x", partition=i % 2) for i, mid in enumerate(ids)]
        )
        consumer = consumer_for(kafka_helper, db, topic, batch_size=10)
        with running(consumer, db):
            wait_for(
                lambda: (
                    kafka_helper.committed(consumer.group_id or "", topic)
                    == kafka_helper.end_offsets(topic)
                ),
                30,
                f"attempt {attempt}: everything committed",
            )
        counts = row_counts(db.engine, db.prefix)
        assert all(counts.get(mid) == 1 for mid in ids)
