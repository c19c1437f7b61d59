"""Offsets stored in the business transaction (``offsets_in_database``), on real Kafka
and PostgreSQL: effects once across a restart whose broker commits were lost, the offset
rows equal to the group's committed offsets, known duplicates without claims, dead
letters advancing the row, every handler style."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
from sqlalchemy import func, insert, select

from mqdedup import Message, Metrics, StopToken, ids
from mqdedup.consumers.async_consumer import AsyncContext
from mqdedup.db.schema import schema
from mqdedup.kafka import AsyncKafkaConsumer
from tests.integration.kafka.consumers import FAST_GROUP, TestOrders, make_consumer
from tests.integration.kafka.helpers import row_counts, total_rows
from tests.services import KafkaHelper, Outgoing, TestDatabase, unique_name, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration


@contextmanager
def running(consumer: type[TestOrders], db: TestDatabase) -> Iterator[Metrics]:
    """Run ``consumer`` on a thread; stop it gracefully at the end."""
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


def offset_rows(db: TestDatabase, group: str, topic: str) -> dict[int, int | None]:
    table = schema(db.prefix).kafka_offsets
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(table.c.partition, table.c.next_offset).where(
                table.c.group_id == group, table.c.topic == topic
            )
        ).all()
    return {row.partition: row.next_offset for row in rows}


def claim_rows(db: TestDatabase) -> int:
    table = schema(db.prefix).processed
    with db.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def lose_broker_commits(kafka_helper: KafkaHelper, group: str, topic: str) -> None:
    """Commit offset 0 for every partition of ``topic`` in ``group``: as if every
    commit after the database's had been lost."""
    import kafka
    from kafka.structs import OffsetAndMetadata, TopicPartition

    consumer = kafka.KafkaConsumer(
        bootstrap_servers=kafka_helper.bootstrap, group_id=group, enable_auto_commit=False
    )
    try:
        partitions = sorted(consumer.partitions_for_topic(topic) or ())
        consumer.commit(
            {TopicPartition(topic, p): OffsetAndMetadata(0, "", -1) for p in partitions}
        )
    finally:
        consumer.close()


def settled_everywhere(kafka_helper: KafkaHelper, db: TestDatabase, group: str, topic: str):  # type: ignore[no-untyped-def]
    ends = kafka_helper.end_offsets(topic)
    return lambda: (
        kafka_helper.committed(group, topic) == ends and offset_rows(db, group, topic) == ends
    )


@pytest.mark.parametrize("style", ["handle", "handle_batch", "stage"])
def test_effects_once_across_a_restart_whose_broker_commits_were_lost(
    kafka_helper: KafkaHelper, db: TestDatabase, style: str
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    group = unique_name("group")
    first = [Outgoing(f"m-{i}", f"body-{i}".encode(), partition=i % 2) for i in range(300)]
    kafka_helper.produce(topic, first)
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        bulk=style == "handle_batch",
        staged=style == "stage",
        batch_size=100,
        offsets_in_database=True,
        message_id_strategy=ids.from_coordinates,
    )
    with running(consumer, db):
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "300 settled")
    assert total_rows(db.engine, db.prefix) == 300

    # Every broker commit lost: the restart is handed every record again.
    lose_broker_commits(kafka_helper, group, topic)
    more = [Outgoing(f"n-{i}", f"body-n-{i}".encode(), partition=i % 2) for i in range(100)]
    kafka_helper.produce(topic, more)
    with running(consumer, db) as metrics:
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "400 settled")

    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 400 and set(counts.values()) == {1}  # effects once
    assert metrics.processed == 100
    assert metrics.duplicates == 300  # below the stored offsets: known duplicates
    assert claim_rows(db) == 0  # coordinate identity: one row per partition, no claims
    assert offset_rows(db, group, topic) == kafka_helper.end_offsets(topic)


def test_a_producer_id_strategy_still_claims_and_catches_producer_duplicates(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    group = unique_name("group")
    messages = [Outgoing(f"m-{i}", b"x") for i in range(50)]
    messages += [Outgoing(f"m-{i}", b"x") for i in range(10)]  # a producer's resends
    kafka_helper.produce(topic, messages)
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        offsets_in_database=True,  # message ids from the message-id header
    )
    with running(consumer, db) as metrics:
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "60 settled")
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 50 and set(counts.values()) == {1}
    assert claim_rows(db) == 50
    assert metrics.duplicates == 10
    assert offset_rows(db, group, topic) == {0: 60}

    lose_broker_commits(kafka_helper, group, topic)
    with running(consumer, db) as metrics:
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "60 settled again")
    assert metrics.duplicates == 60 and metrics.processed == 0
    assert claim_rows(db) == 50  # below the stored offset: skipped without a claim


def test_a_dead_letter_advances_the_offset_row_like_a_processed_record(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    group = unique_name("group")
    kafka_helper.produce(topic, [Outgoing(f"m-{i}", b"x") for i in range(10)])
    poison = f"{topic}/0/4"  # coordinate ids
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        bulk=False,
        offsets_in_database=True,
        message_id_strategy=ids.from_coordinates,
        fail_ids=frozenset({poison}),
    )
    with running(consumer, db) as metrics:
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "10 settled")
    assert total_rows(db.engine, db.prefix) == 9
    assert metrics.dead_lettered == 1 and metrics.retries == 2
    dead = kafka_helper.read_all(f"{topic}.DLT", 1)
    assert [record.offset for record in dead] == [0]
    assert offset_rows(db, group, topic) == {0: 10}

    lose_broker_commits(kafka_helper, group, topic)
    with running(consumer, db) as metrics:
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "10 settled again")
    assert metrics.duplicates == 10 and metrics.dead_lettered == 0
    assert total_rows(db.engine, db.prefix) == 9


def test_a_replay_below_the_stored_offsets_finds_every_record_a_duplicate(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    group = unique_name("group")
    kafka_helper.produce(topic, [Outgoing(f"m-{i}", b"x", partition=i % 2) for i in range(40)])
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        offsets_in_database=True,
        message_id_strategy=ids.from_coordinates,
    )
    with running(consumer, db):
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "40 settled")

    report = consumer().replay(db.engine)
    assert (report.new, report.duplicates) == (0, 40)
    assert total_rows(db.engine, db.prefix) == 40 and claim_rows(db) == 0
    assert offset_rows(db, group, topic) == kafka_helper.end_offsets(topic)  # untouched


class AsyncOrders(AsyncKafkaConsumer):
    """One order row per message through the AsyncSession."""

    __test__ = False
    topics = ("set-by-the-test",)
    offsets_in_database = True
    message_id_strategy = ids.from_coordinates
    batch_size = 20
    kafka_config: ClassVar[Mapping[str, Any]] = FAST_GROUP

    async def handle(self, message: Message, ctx: AsyncContext) -> None:
        await ctx.session.execute(
            insert(orders_table(self.table_prefix)).values(message_id=message.id, body="x")
        )


def test_an_async_consumer_stores_its_offsets_in_the_same_transaction(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    group = unique_name("group")
    kafka_helper.produce(topic, [Outgoing(f"m-{i}", b"x", partition=i % 2) for i in range(60)])
    consumer = type(
        "AsyncOrders_" + group.replace("-", "_"),
        (AsyncOrders,),
        {
            "topics": [topic],
            "group_id": group,
            "table_prefix": db.prefix,
            "bootstrap_servers": kafka_helper.bootstrap,
        },
    )
    with running(consumer, db):  # type: ignore[arg-type]
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "60 settled")
    lose_broker_commits(kafka_helper, group, topic)
    with running(consumer, db) as metrics:  # type: ignore[arg-type]
        wait_for(settled_everywhere(kafka_helper, db, group, topic), 60, "60 settled again")
    assert metrics.duplicates == 60 and metrics.processed == 0
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 60 and set(counts.values()) == {1}
    assert claim_rows(db) == 0


def test_a_second_member_joining_mid_run_applies_each_record_once(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    """A rebalance moves partitions between two members while records flow: the new
    owner reads the stored offsets; effects once; rows equal the committed offsets."""
    topic = kafka_helper.create_topic(partitions=4)
    group = unique_name("group")
    kafka_helper.produce(topic, [Outgoing(f"m-{i}", b"x", partition=i % 4) for i in range(2000)])
    consumer = make_consumer(
        topic=topic,
        group=group,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        batch_size=50,
        offsets_in_database=True,
        message_id_strategy=ids.from_coordinates,
        static_membership=False,  # two members in one process
        delay=0.1,
    )
    with running(consumer, db) as first:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 200, 60, "the first rows")
        with running(consumer, db) as second:
            wait_for(settled_everywhere(kafka_helper, db, group, topic), 90, "2000 settled")
    assert first.processed > 0 and second.processed > 0  # the partitions did move
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 2000 and set(counts.values()) == {1}
    assert claim_rows(db) == 0
    assert offset_rows(db, group, topic) == kafka_helper.committed(group, topic)
