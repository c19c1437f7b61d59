"""The relay on SQLite with the in-memory publisher: claim, mark, retry, fail, purge."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.orm import Session

from mqdedup import InMemoryBroker, Message, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.db.schema import schema
from mqdedup.dedup.store import utcnow
from mqdedup.errors import ConfigurationError
from mqdedup.outbox import MemoryPublisher, OutboxStore, OutboxWriter, Relay, RelayConfig
from mqdedup.stopping import StopToken
from tests.support import OrderConsumer, order_counts, orders

OUTBOX = schema().outbox
FAST = RelayConfig(
    batch_size=50, poll_interval=0.01, initial_backoff=0.05, max_backoff=0.05, max_attempts=3
)


def write(engine: Engine, count: int, *, key: str | None = None, topic: str = "t") -> list[str]:
    with Session(engine) as session, session.begin():
        writer = OutboxWriter(session)
        return [writer.publish(f"{n}".encode(), topic=topic, key=key) for n in range(count)]


def states(engine: Engine) -> dict[str, str]:
    with engine.connect() as connection:
        rows = connection.execute(select(OUTBOX.c.message_id, OUTBOX.c.state)).all()
    return {row[0]: row[1] for row in rows}


def relay_for(engine: Engine, publisher: MemoryPublisher, **config: Any) -> Relay:
    settings = {**FAST.__dict__, **config}
    return Relay(
        engine, {"kafka": publisher, "rabbitmq": publisher}, config=RelayConfig(**settings)
    )


def test_committed_rows_are_published_in_id_order_and_marked(sqlite_engine: Engine) -> None:
    ids = write(sqlite_engine, 120)
    publisher = MemoryPublisher()

    metrics = relay_for(sqlite_engine, publisher, delete_published=False).drain(timeout=10)

    assert publisher.published_ids() == ids
    assert set(states(sqlite_engine).values()) == {"published"}
    assert (metrics.published, metrics.batches) == (120, 3)
    status = OutboxStore().status(sqlite_engine)
    assert (status.pending, status.failed, status.published) == (0, 0, 120)


def test_published_rows_are_deleted_by_default_and_status_still_counts_them(
    sqlite_engine: Engine,
) -> None:
    write(sqlite_engine, 10)
    relay = Relay(sqlite_engine, {"kafka": MemoryPublisher()})  # the default settings
    relay.drain(timeout=10)
    write(sqlite_engine, 5)  # this hour's counter grows
    relay.drain(timeout=10)
    assert states(sqlite_engine) == {}
    status = OutboxStore().status(sqlite_engine)
    assert (status.pending, status.published) == (0, 15)
    assert [(d.destination, d.published) for d in status.destinations] == [("t", 15)]


def test_published_record_carries_everything_the_writer_stored(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session, consumer_name="c", causation_id="in-1")
        message_id = writer.publish(
            {"x": 1}, exchange="ex", routing_key="rk", key="k", headers={"h": "v"}
        )
    publisher = MemoryPublisher()
    relay_for(sqlite_engine, publisher).drain(timeout=10)

    [record] = publisher.published
    assert (record.message_id, record.broker, record.destination, record.routing_key) == (
        message_id,
        "rabbitmq",
        "ex",
        "rk",
    )
    assert (record.key, record.payload) == (b"k", b'{"x":1}')
    assert record.headers == {"message-id": message_id, "causation-id": "in-1", "h": "v"}
    assert record.properties == {"message_id": message_id, "content_type": "application/json"}


def test_refused_row_is_retried_with_backoff_then_failed_and_kept(sqlite_engine: Engine) -> None:
    [bad] = write(sqlite_engine, 1, topic="too-large")
    good = write(sqlite_engine, 5)
    publisher = MemoryPublisher(
        reject=lambda r: "too large" if r.destination == "too-large" else None
    )
    relay = relay_for(
        sqlite_engine, publisher, initial_backoff=0.4, max_backoff=0.4, delete_published=False
    )

    relay.run_once()  # attempt 1: the good rows go out, the bad one waits for its backoff
    assert publisher.published_ids() == good
    with sqlite_engine.connect() as connection:
        row = connection.execute(select(OUTBOX).where(OUTBOX.c.message_id == bad)).one()
    assert (row.state, row.attempts, row.last_error) == ("pending", 1, "too large")
    assert relay.run_once().claimed == 0  # not due yet

    deadline = time.monotonic() + 5
    while states(sqlite_engine)[bad] != "failed" and time.monotonic() < deadline:
        relay.run_once()
        time.sleep(0.01)

    assert states(sqlite_engine)[bad] == "failed"
    assert relay.metrics.failed == 1 and relay.metrics.rejected == 3
    status = OutboxStore().status(sqlite_engine)
    assert (status.failed, status.pending, status.published) == (1, 0, 5)

    publisher.reject = None  # the operator fixed the cause
    assert relay.retry_failed() == 1
    relay.drain(timeout=10)
    assert states(sqlite_engine)[bad] == "published"
    assert publisher.published_ids()[-1] == bad


def test_broker_outage_releases_rows_without_counting_attempts(sqlite_engine: Engine) -> None:
    ids = write(sqlite_engine, 30)
    publisher = MemoryPublisher()
    publisher.available = False
    relay = relay_for(sqlite_engine, publisher, broker_backoff_max=0.05)

    for _ in range(5):
        relay.run_once()
        time.sleep(0.06)

    with sqlite_engine.connect() as connection:
        rows = connection.execute(select(OUTBOX.c.attempts, OUTBOX.c.state)).all()
        leases = connection.execute(select(schema().outbox_leases)).all()
    assert {tuple(row) for row in rows} == {(0, "pending")}
    assert leases == [], "the relay keeps no lease between bursts"
    assert relay.metrics.broker_outages == 1 and relay.metrics.unavailable >= 30

    publisher.available = True
    time.sleep(0.06)
    relay.drain(timeout=10)
    assert publisher.published_ids() == ids
    assert OutboxStore().status(sqlite_engine).failed == 0


def test_paused_broker_does_not_hold_up_the_other_one(sqlite_engine: Engine) -> None:
    down = MemoryPublisher()
    down.available = False
    up = MemoryPublisher()
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session)
        for n in range(100):
            writer.publish(b"k", topic="t")  # all Kafka rows first (lower ids)
        for n in range(20):
            writer.publish(b"r", exchange="x", routing_key="r")
    relay = Relay(
        sqlite_engine,
        {"kafka": down, "rabbitmq": up},
        config=RelayConfig(batch_size=50, poll_interval=0.01, broker_backoff_max=5),
    )

    for _ in range(3):
        relay.run_once()

    assert len(up.published) == 20
    assert down.published == []


def test_a_key_waits_for_its_refused_row_while_other_keys_proceed(
    sqlite_engine: Engine,
) -> None:
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session)
        blocked_first = writer.publish(b"bad", topic="t", key="A")
    publisher = MemoryPublisher(reject=lambda r: "refused" if r.payload == b"bad" else None)
    relay = relay_for(sqlite_engine, publisher, initial_backoff=0.3, max_backoff=0.3)
    relay.run_once()  # A#1 refused, waits 0.3 s
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session)
        a2 = writer.publish(b"a2", topic="t", key="A")
        b1 = writer.publish(b"b1", topic="t", key="B")

    relay.run_once()
    assert publisher.published_ids() == [b1]  # A#2 must not overtake A#1

    publisher.reject = None
    deadline = time.monotonic() + 5
    while len(publisher.published) < 3 and time.monotonic() < deadline:
        relay.run_once()
        time.sleep(0.01)
    assert publisher.published_ids() == [b1, blocked_first, a2]


def test_expired_lease_lets_another_relay_reclaim_a_crashed_relays_rows(
    sqlite_engine: Engine,
) -> None:
    ids = write(sqlite_engine, 10)
    store = OutboxStore()
    crashed = store.claim(
        sqlite_engine, "crashed-relay", 100, timedelta(seconds=0.3), brokers=["kafka"]
    )
    assert [r.message_id for r in crashed] == ids
    publisher = MemoryPublisher()
    relay = relay_for(sqlite_engine, publisher)

    assert relay.run_once().claimed == 0  # leased by the crashed relay
    time.sleep(0.35)
    relay.drain(timeout=10)
    assert publisher.published_ids() == ids


def test_rows_written_while_a_relay_waits_are_not_skipped(sqlite_engine: Engine) -> None:
    """Claim by state: an older id committed after a newer one is still published."""
    with Session(sqlite_engine) as session, session.begin():
        early = OutboxWriter(session).publish(b"early", topic="t")
    # Simulate a transaction that took id 1 but commits late: mark it not yet visible.
    with sqlite_engine.begin() as connection:
        connection.execute(update(OUTBOX).values(state="invisible"))
    later = write(sqlite_engine, 3)
    publisher = MemoryPublisher()
    relay = relay_for(sqlite_engine, publisher)
    relay.drain(timeout=10)
    with sqlite_engine.begin() as connection:  # the late transaction commits
        connection.execute(
            update(OUTBOX).where(OUTBOX.c.message_id == early).values(state="pending")
        )
    relay.drain(timeout=10)
    assert publisher.published_ids() == [*later, early]


def test_delayed_row_waits_until_due(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as session, session.begin():
        delayed = OutboxWriter(session).publish(b"later", topic="t", delay=3600)
    publisher = MemoryPublisher()
    relay = relay_for(sqlite_engine, publisher)
    assert relay.run_once().claimed == 0
    with sqlite_engine.begin() as connection:  # the hour has passed
        connection.execute(update(OUTBOX).values(available_at=utcnow() - timedelta(seconds=1)))
    relay.drain(timeout=10)
    assert publisher.published_ids() == [delayed]


def test_purge_deletes_old_published_rows_in_chunks_only(sqlite_engine: Engine) -> None:
    old = write(sqlite_engine, 25)
    relay_for(sqlite_engine, MemoryPublisher(), retention=None, delete_published=False).drain(
        timeout=10
    )
    failed = write(sqlite_engine, 3, topic="unpublished")
    with sqlite_engine.begin() as connection:
        connection.execute(
            update(OUTBOX)
            .where(OUTBOX.c.state == "published")
            .values(published_at=utcnow() - timedelta(days=8))
        )
    recent = write(sqlite_engine, 2)
    publisher = MemoryPublisher(reject=lambda r: "no" if r.destination == "unpublished" else None)
    relay = Relay(
        sqlite_engine,
        {"kafka": publisher},
        config=RelayConfig(
            max_attempts=1,
            retention=timedelta(days=7),
            purge_chunk_size=10,
            poll_interval=0.01,
            delete_published=False,
        ),
    )

    metrics = relay.drain(timeout=10)  # purges (maintenance), publishes `recent`, fails the rest

    assert metrics.purged == 25
    remaining = states(sqlite_engine)
    assert set(remaining) == set(failed) | set(recent)
    assert not set(old) & set(remaining)
    assert OutboxStore().purge(sqlite_engine, timedelta(seconds=0), chunk_size=1) == 2
    assert set(states(sqlite_engine)) == set(failed)  # failed rows are never purged


def test_status_reports_oldest_due_pending_age_per_destination(sqlite_engine: Engine) -> None:
    write(sqlite_engine, 2, topic="a")
    write(sqlite_engine, 1, topic="b")
    with sqlite_engine.begin() as connection:
        connection.execute(
            update(OUTBOX)
            .where(OUTBOX.c.destination == "a")
            .values(available_at=utcnow() - timedelta(seconds=90))
        )
    status = OutboxStore().status(sqlite_engine)
    by_topic = {d.destination: d for d in status.destinations}
    assert by_topic["a"].pending == 2 and by_topic["b"].pending == 1
    assert by_topic["a"].oldest_pending_age is not None
    assert 89 < by_topic["a"].oldest_pending_age < 120
    assert status.oldest_pending_age == by_topic["a"].oldest_pending_age
    assert status.as_dict()["pending"] == 3


def test_run_stops_gracefully_after_marking_its_batch(sqlite_engine: Engine) -> None:
    ids = write(sqlite_engine, 40)
    stop = StopToken()

    class StopAfterFirstBatch(MemoryPublisher):
        def publish_batch(self, records: Any) -> Any:
            stop.request()  # a SIGTERM arriving mid-batch
            return super().publish_batch(records)

    publisher = StopAfterFirstBatch()
    config = RelayConfig(batch_size=10, poll_interval=0.01, delete_published=False)
    relay = Relay(sqlite_engine, {"kafka": publisher}, config=config)
    metrics = relay.run(stop)

    assert metrics.published == 10
    assert [i for i, s in states(sqlite_engine).items() if s == "published"] == ids[:10]
    assert publisher.closed


def test_run_wakes_for_new_rows_and_returns_on_stop(sqlite_engine: Engine) -> None:
    publisher = MemoryPublisher()
    stop = StopToken()
    relay = relay_for(sqlite_engine, publisher)
    thread = threading.Thread(target=relay.run, args=(stop,))
    thread.start()
    try:
        ids = write(sqlite_engine, 5)
        deadline = time.monotonic() + 10
        while len(publisher.published) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.request()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert publisher.published_ids() == ids


def test_rows_for_a_broker_without_publisher_are_left_alone(sqlite_engine: Engine) -> None:
    with Session(sqlite_engine) as session, session.begin():
        OutboxWriter(session).publish(b"r", exchange="x", routing_key="r")
    relay = Relay(sqlite_engine, {"kafka": MemoryPublisher()}, config=FAST)
    assert relay.run_once().claimed == 0
    assert set(states(sqlite_engine).values()) == {"pending"}


def test_publisher_that_raises_counts_as_unavailable(sqlite_engine: Engine) -> None:
    write(sqlite_engine, 3)

    class Broken(MemoryPublisher):
        def publish_batch(self, records: Any) -> Any:
            raise RuntimeError("client bug")

    relay = Relay(sqlite_engine, {"kafka": Broken()}, config=FAST)
    report = relay.run_once()
    assert len(report.unavailable) == 3
    assert set(states(sqlite_engine).values()) == {"pending"}


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"lease": 0}, "lease"),
        ({"purge_chunk_size": 0}, "purge_chunk_size"),
    ],
)
def test_bad_relay_settings_are_refused(settings: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ConfigurationError, match=complaint):
        RelayConfig(**settings)


def test_relay_needs_a_publisher(sqlite_engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="at least one publisher"):
        Relay(sqlite_engine, {})


class Forwarder(OrderConsumer):
    name = "a"

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(insert(orders).values(message_id=message.id, order_id="a"))
        ctx.outbox.publish(message.body, topic="to-b", key=message.id)
        return None


class Receiver(OrderConsumer):
    name = "b"

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(insert(orders).values(message_id=message.id, order_id="b"))
        return None


def test_chain_with_duplicates_and_republished_rows_has_each_effect_once(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker(seed=5)
    for number in range(200):
        broker.publish("in", json.dumps({"n": number}), message_id=f"in-{number}")
    broker.inject_duplicates("in", 0.3)
    run_until_idle(Forwarder(), broker.transport("in"), sqlite_engine)

    publisher = MemoryPublisher(broker)
    relay = relay_for(sqlite_engine, publisher, delete_published=False)
    relay.drain(timeout=10)
    with sqlite_engine.begin() as connection:  # a relay crash before marking: all again
        connection.execute(update(OUTBOX).values(state="pending"))
    relay.drain(timeout=10)
    assert len(publisher.published) == 400
    metrics = run_until_idle(Receiver(), broker.transport("to-b"), sqlite_engine)

    with sqlite_engine.connect() as connection:
        rows = connection.execute(select(orders.c.order_id, orders.c.message_id)).all()
    b_ids = [message_id for order_id, message_id in rows if order_id == "b"]
    assert len(b_ids) == len(set(b_ids)) == 200
    assert metrics.duplicates == 200
    assert len(order_counts(sqlite_engine)) == 400


# -- MySQL / MariaDB (no server needed: construction and statements only) -------------------


def test_a_relay_on_mysql_or_mariadb_uses_named_lock_shards_and_polls() -> None:
    from sqlalchemy import create_engine

    from mqdedup.outbox.coordination import MySQLCoordinator
    from mqdedup.outbox.relay_coordination import SharedShards

    for url in ("mysql+pymysql://u:p@127.0.0.1:1/db", "mariadb+pymysql://u:p@127.0.0.1:1/db"):
        engine = create_engine(url)  # never connects: the relay opens connections lazily
        relay = Relay(engine, {"kafka": MemoryPublisher()}, config=RelayConfig(shards=8))
        assert isinstance(relay.coordination, SharedShards)
        assert isinstance(relay.coordination.coordinator, MySQLCoordinator)
        assert relay.coordination.coordinator.shards == 8
        # no LISTEN: idle sleeps the poll interval
        assert relay.coordination.coordinator.notifies is False
        relay.close()
        engine.dispose()


def test_mysql_lock_names_fit_the_64_character_limit_and_differ_per_database_and_table() -> None:
    from mqdedup.outbox.coordination import lock_namespace, shard_lock_name

    names = {
        shard_lock_name(lock_namespace(database, table), 4095)
        for database in ("a" * 64, "b")
        for table in ("x" * 64 + "outbox", "mqdedup_outbox")
    }
    assert len(names) == 4
    assert max(len(name) for name in names) <= 64


def test_the_mysql_claim_reads_without_row_locks() -> None:
    """No SKIP LOCKED on InnoDB (its scan would hide another relay's rows and reorder a
    key); shards keep relays apart, the batch lease is one row per relay."""
    from sqlalchemy.dialects import mysql

    store = OutboxStore()
    claim_sql = str(store._claim_read(True).compile(dialect=mysql.dialect()))
    assert "FOR UPDATE" not in claim_sql and "SKIP LOCKED" not in claim_sql
    assert "ORDER BY candidate.id" in claim_sql and "LIMIT" in claim_sql
    assert "pg_locks" not in claim_sql  # the named locks are checked by IS_USED_LOCK


def test_a_relay_gets_one_coordination_object_for_its_mode_chosen_once() -> None:
    """Built without connecting: the mode and the database pick the class."""
    from sqlalchemy import create_engine

    from mqdedup.outbox.relay_coordination import SharedShards, SingleRelay, TakingTurns

    cases = [
        ("sqlite://", "session", SingleRelay, False),
        ("mysql+pymysql://u:p@127.0.0.1:1/db", "session", SharedShards, True),
        ("postgresql+psycopg://u:p@127.0.0.1:1/db", "session", SharedShards, True),
        ("postgresql+psycopg://u:p@127.0.0.1:1/db", "transaction", TakingTurns, False),
    ]
    for url, mode, kind, dedicated in cases:
        engine = create_engine(url)
        relay = Relay(engine, {"kafka": MemoryPublisher()}, config=RelayConfig(coordination=mode))
        assert type(relay.coordination) is kind, (url, mode)
        assert relay.coordination.dedicated_connections is dedicated
        relay.close()
        engine.dispose()
    with pytest.raises(ConfigurationError, match="coordination must be one of"):
        RelayConfig(coordination="turns")
