"""Zombies are fenced: a worker that lost its partition and commits late applies nothing.

The offset row of ``offsets_in_database`` is written conditionally on the owner epoch
each new owner bumps, in the batch's own transaction. These tests race two owners of one
partition on the real PostgreSQL (two sessions), through the Processor the workers run;
the Kafka side is the group member's own bookkeeping (the offset tracker), no broker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.orm import Session, sessionmaker

from mqdedup import Context, Message, RetryPolicy, StopToken, ids
from mqdedup.consumers.positions import PositionFencedError
from mqdedup.consumers.processor import Processor
from mqdedup.consumers.transport import DeadLetter, Delivery, new_delivery
from mqdedup.db.engine import session_factory
from mqdedup.db.schema import schema
from mqdedup.kafka import KafkaConsumer
from mqdedup.kafka.offset_store import OffsetRows
from mqdedup.kafka.offsets import OffsetTracker
from mqdedup.kafka.records import KafkaToken, kafka_token
from tests.integration.kafka.helpers import total_rows
from tests.services import TestDatabase, prefixed_database, table_prefix, unique_name, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration

TOPIC = "orders"
KEY = (TOPIC, 0)


class Orders(KafkaConsumer):
    topics: ClassVar[Sequence[str]] = [TOPIC]
    offsets_in_database = True
    message_id_strategy = ids.from_coordinates
    business_prefix: ClassVar[str] = ""
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.01)
    fail_offsets: ClassVar[frozenset[int]] = frozenset()

    def handle(self, message: Message, ctx: Context) -> None:
        if message.offset in self.fail_offsets:
            raise ValueError(f"cannot handle {message.offset}")
        ctx.session.execute(
            insert(orders_table(self.business_prefix)).values(
                message_id=message.id, body="x", worker=""
            )
        )


class Member:
    """One group member's side: its tracker, its stored offsets and a transport."""

    def __init__(
        self,
        db: TestDatabase,
        group: str,
        *,
        fail: frozenset[int] = frozenset(),
        stopping: bool = False,
    ) -> None:
        self.tracker = OffsetTracker()
        self.positions = OffsetRows(group, group, self.tracker, prefix=db.prefix, claims=False)
        self.settled: list[Delivery[KafkaToken]] = []
        consumer = type(
            "Orders_" + group.replace("-", "_"),
            (Orders,),
            {
                "group_id": group,
                "table_prefix": db.prefix,
                "business_prefix": db.prefix,
                "fail_offsets": fail,
            },
        )()
        self.sessions: sessionmaker[Session] = session_factory(db.engine)
        stop = StopToken()
        if stopping:  # a failure's retry is left to the next owner (as on a crash)
            stop.request()
        self.processor = Processor(consumer, self.sessions, self, stop=stop)

    def deliver(self, offsets: range) -> list[Delivery[KafkaToken]]:
        tracked = self.tracker.track_many(KEY, list(offsets))
        deliveries = []
        for offset, track in zip(offsets, tracked, strict=True):
            assert track is not None
            message = Message(body=b"x", source=TOPIC, partition=0, offset=offset)
            deliveries.append(new_delivery(message, kafka_token(KEY, offset, track[0], None)))
        return deliveries

    # -- the Transport protocol (what the Processor calls) ------------------------------

    def settle(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        self.settled.extend(deliveries)
        self.tracker.settle_many(
            (d.token.partition, d.token.offset, d.token.epoch) for d in deliveries
        )

    def give_back(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        raise AssertionError("the Processor leaves giving back to the Worker")

    def dead_letter(self, delivery: Delivery[KafkaToken], record: DeadLetter) -> None:
        raise AssertionError(f"nothing is dead-lettered here: {record.reason}")

    def keepalive(self) -> None:
        pass


def stored(db: TestDatabase, group: str) -> tuple[int | None, int]:
    table = schema(db.prefix).kafka_offsets
    with db.engine.connect() as connection:
        row = connection.execute(
            select(table.c.next_offset, table.c.owner_epoch).where(table.c.group_id == group)
        ).one()
    return row.next_offset, row.owner_epoch


@pytest.fixture(params=["postgresql", "mariadb"])
def any_db(request: pytest.FixtureRequest) -> Iterator[TestDatabase]:
    """The test's tables on PostgreSQL, then on MariaDB (``partition`` is a reserved word
    there; the conditional UPDATE's row count must be the rows it matched)."""
    if request.param == "postgresql":
        yield request.getfixturevalue("db")
        return
    url = request.getfixturevalue("mariadb_url")
    prefix = table_prefix()
    with prefixed_database(url, "MariaDB", orders_table(prefix).metadata, prefix=prefix) as db:
        yield db


def test_a_late_commit_of_a_worker_that_lost_its_partition_rolls_back_its_effects(
    any_db: TestDatabase,
) -> None:
    db = any_db
    group = unique_name("group")
    old = Member(db, group)
    report = old.processor.process(old.deliver(range(0, 5)))
    assert len(report.processed) == 5 and stored(db, group)[0] == 5

    # The old owner pauses (GC, network) holding records 5..9; the group moves the
    # partition to a new owner, which reads the stored offset and processes them.
    late = old.deliver(range(5, 10))
    new = Member(db, group)
    report = new.processor.process(new.deliver(range(5, 10)))
    assert len(report.processed) == 5
    assert total_rows(db.engine, db.prefix) == 10 and stored(db, group)[0] == 10

    # The old owner wakes up and commits its batch: fenced, nothing of it applies.
    report = old.processor.process(late)
    assert report.processed == [] and report.unsettled == late
    assert old.settled[5:] == []  # not settled: the Worker gives the batch back
    assert total_rows(db.engine, db.prefix) == 10
    assert stored(db, group)[0] == 10

    # Until the group tells it, the fenced member gives its records back untouched.
    held = old.deliver(range(5, 10))
    report = old.processor.process(held)
    assert report.unsettled == held and report.processed == report.duplicates == []

    # Assigned the partition again (the rebalance listener forgets what it read), the
    # old owner reads the stored offset again and finds them done.
    old.positions.forget([KEY])
    again = old.deliver(range(5, 10))
    report = old.processor.process(again)
    assert report.duplicates == again and report.processed == []
    assert total_rows(db.engine, db.prefix) == 10


def test_two_owners_racing_serialize_on_the_offset_row(db: TestDatabase) -> None:
    """The new owner's read waits for the old owner's transaction in flight: either that
    transaction commits first (and the new owner starts after its records) or its write
    finds the epoch moved on (and it rolls back)."""
    group = unique_name("group")
    old = Member(db, group)
    first = old.deliver(range(0, 3))
    old.processor.process(first)
    assert stored(db, group) == (3, 1)

    in_flight = old.deliver(range(3, 6))
    business = orders_table(db.prefix)
    new = Member(db, group)
    taken: list[Any] = []
    with old.sessions() as session, session.begin():
        for delivery in in_flight:
            session.execute(
                insert(business).values(
                    message_id=f"direct-{delivery.token.offset}", body="x", worker=""
                )
            )
        committed = old.positions.write(session, in_flight)  # holds the row until commit
        reader = threading.Thread(
            target=lambda: taken.append(new.positions.done(new.sessions, new.deliver(range(3, 6))))
        )
        reader.start()
        wait_for(lambda: _waiting_for_a_lock(db), 20, "the new owner waiting for the row lock")
        assert not taken
    committed()
    reader.join(20)
    assert not reader.is_alive()
    [(done, again)] = taken
    assert [d.token.offset for d in done] == [3, 4, 5] and again == []  # it saw the commit
    assert stored(db, group) == (6, 2)

    # From now on the old owner's writes are fenced, with their effects.
    with pytest.raises(PositionFencedError), old.sessions() as session, session.begin():
        late = old.deliver(range(6, 8))
        session.execute(insert(business).values(message_id="late", body="x", worker=""))
        old.positions.write(session, late)
    assert total_rows(db.engine, db.prefix) == 6


def test_a_record_being_retried_holds_the_offset_its_batch_mates_do_not_run_twice(
    db: TestDatabase,
) -> None:
    group = unique_name("group")
    first = Member(db, group, fail=frozenset({2}), stopping=True)
    report = first.processor.process(first.deliver(range(0, 5)))
    assert [d.token.offset for d in report.processed] == [0, 1, 3, 4]
    assert [d.token.offset for d in report.unsettled] == [2]
    assert stored(db, group)[0] == 2  # the failing record holds the offset
    table = schema(db.prefix).kafka_offsets
    with db.engine.connect() as connection:
        assert connection.execute(select(table.c.done_above)).scalar_one() == "3,4"

    # The worker dies; the next owner gets all five again: only the held one runs.
    second = Member(db, group)
    again = second.deliver(range(0, 5))
    report = second.processor.process(again)
    assert [d.token.offset for d in report.duplicates] == [0, 1, 3, 4]
    assert [d.token.offset for d in report.processed] == [2]
    assert total_rows(db.engine, db.prefix) == 5
    assert stored(db, group)[0] == 5
    with db.engine.connect() as connection:
        assert connection.execute(select(table.c.done_above)).scalar_one() is None


def test_a_fenced_member_reads_the_stored_offset_again_after_the_session_timeout(
    db: TestDatabase,
) -> None:
    """The other owner may have been the zombie: past the group's session timeout (here 0)
    the fenced member takes the partition back, from the stored offset."""
    group = unique_name("group")
    first = Member(db, group)
    first.positions.fence_hold = 0.0
    first.processor.process(first.deliver(range(0, 3)))
    late = first.deliver(range(3, 6))
    other = Member(db, group)
    other.processor.process(other.deliver(range(3, 5)))
    assert first.processor.process(late).unsettled == late  # fenced
    report = first.processor.process(first.deliver(range(3, 6)))
    assert [d.token.offset for d in report.duplicates] == [3, 4]
    assert [d.token.offset for d in report.processed] == [5]
    assert total_rows(db.engine, db.prefix) == 6 and stored(db, group)[0] == 6


def _waiting_for_a_lock(db: TestDatabase) -> bool:
    with db.engine.connect() as connection:
        waiting = connection.execute(
            text("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'")
        ).scalar_one()
    return int(waiting) > 0
