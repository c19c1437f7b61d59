"""The relay's batch lease and delete-marking, on real PostgreSQL and MariaDB.

* A claim writes nothing on the rows: its lease is one row per relay. A relay that dies
  mid-publish (lease taken, rows pending) holds its shards until the lease expires; then
  another relay publishes every row, with the same message ids, keys in order.
* ``delete_published``: rows leave the table once published, and ``status`` / the
  retention still answer how many were published, per destination.

The relays here publish to a :class:`MemoryPublisher` (what is under test is the
database side); the broker side of the same promises is in ``test_outbox_faults.py``
(kill -9 with real Kafka / RabbitMQ).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from mqdedup.cli.admin import outbox_status_data
from mqdedup.dedup.store import utcnow
from mqdedup.outbox import MemoryPublisher, OutboxStore, OutboxWriter, Relay, RelayConfig
from mqdedup.outbox.coordination import MySQLCoordinator, PostgreSQLCoordinator
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.outbox.writer import OutgoingMessage
from tests.integration.outbox.helpers import OutboxDb, events_table, order_problems, poll_until
from tests.services import prefixed_database, table_prefix

pytestmark = pytest.mark.integration

SHARDS = 4


@pytest.fixture(params=["postgresql", "mariadb"])
def any_db(request: pytest.FixtureRequest) -> Iterator[OutboxDb]:
    """This test's tables on the shared PostgreSQL, then on the shared MariaDB."""
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "mariadb_url")
    prefix = table_prefix()
    events = events_table(prefix)
    with prefixed_database(url, request.param, events.metadata, prefix=prefix) as shared:
        yield OutboxDb(url=shared.url, engine=shared.engine, prefix=prefix, events=events)


def write(db: OutboxDb, count: int, *, keys: int = 20, **destination: Any) -> list[str]:
    """``count`` rows in one transaction, keys ``k0..`` round robin, payload = sequence."""
    destination = destination or {"topic": "orders"}
    with Session(db.engine) as session, session.begin():
        return OutboxWriter(session, prefix=db.prefix).publish_many(
            OutgoingMessage({"key": f"k{n % keys}", "seq": n}, key=f"k{n % keys}", **destination)
            for n in range(count)
        )


def coordinator(db: OutboxDb, store: OutboxStore) -> Any:
    """A relay's shard coordinator (the lock connection) for ``db``'s outbox."""
    if db.engine.dialect.name == "postgresql":
        return PostgreSQLCoordinator(
            db.engine,
            table_name=store.table.name,
            channel=store.channel,
            shards=SHARDS,
            fingerprint="kafka",
        )
    return MySQLCoordinator(
        db.engine, table_name=store.table.name, shards=SHARDS, fingerprint="kafka"
    )


def test_a_dead_relays_batch_lease_holds_its_shards_until_it_expires_then_all_rows_go_out(
    any_db: OutboxDb,
) -> None:
    db = any_db
    ids = write(db, 1_200)
    store = OutboxStore(db.prefix)
    outbox = store.table
    with db.engine.connect() as connection:
        before = connection.execute(select(outbox).order_by(outbox.c.id)).all()

    # The relay that will die: it owns every shard and claims two batches ahead.
    dead = coordinator(db, store)
    dead.open()
    assert dead.rebalance() == set(range(SHARDS))
    held = dead.shard_filter()
    lease = timedelta(seconds=2)
    first = store.claim(db.engine, "dead", 500, lease, brokers=["kafka"], shard_filter=held)
    second = store.claim(
        db.engine,
        "dead",
        500,
        lease,
        brokers=["kafka"],
        shard_filter=held,
        in_flight=[record.id for record in first],
    )
    assert len(first) == len(second) == 500
    assert not {r.id for r in first} & {r.id for r in second}, "in-flight rows are skipped"
    with db.engine.connect() as connection:
        after = connection.execute(select(outbox).order_by(outbox.c.id)).all()
        leases = connection.execute(select(store.leases.c.relay_id, store.leases.c.shards)).all()
    assert after == before, "a claim writes nothing on the rows"
    assert [tuple(row) for row in leases] == [("dead", "0,1,2,3")], "one lease for both batches"
    dead.close()  # killed mid-publish: its shard locks go, its lease stays

    publisher = MemoryPublisher()
    relay = Relay(
        db.engine,
        {"kafka": publisher},
        prefix=db.prefix,
        config=RelayConfig(shards=SHARDS, listen=False, poll_interval=0.05),
    )
    try:
        taken_at = time.monotonic()
        assert relay.run_once().claimed == 0, "the shards wait for the dead relay's lease"
        poll_until(
            lambda: bool(relay.drain(timeout=10)) and len(publisher.published) >= len(ids),
            30,
            "the rows of the dead relay, once its lease expired",
        )
        waited = time.monotonic() - taken_at
    finally:
        relay.close()

    assert waited >= 1.0, "nothing went out before the lease expired"
    assert sorted(publisher.published_ids()) == sorted(ids), "every row, with its message id"
    assert len(publisher.published_ids()) == len(ids), "each once"
    assert order_problems([key_and_seq(record) for record in publisher.published]) == []
    status = db.status()
    assert (status.pending, status.published) == (0, 1_200)
    with db.engine.connect() as connection:
        holders = connection.execute(select(store.leases.c.relay_id)).scalars().all()
    assert holders == ["dead"], "the live relay removed its lease once its rows were settled"


def key_and_seq(record: OutboxRecord) -> tuple[str, int]:
    """(key, seq) of a published record, for :func:`order_problems`."""
    body = json.loads(record.payload)
    return str(body["key"]), int(body["seq"])


def test_delete_marking_keeps_status_and_retention_answers(any_db: OutboxDb) -> None:
    db = any_db
    write(db, 300, topic="a")
    write(db, 200, topic="b")
    write(db, 100, exchange="ex", routing_key="r")
    publisher = MemoryPublisher()
    config = RelayConfig(delete_published=True, shards=SHARDS, listen=False, batch_size=128)
    relay = Relay(
        db.engine, {"kafka": publisher, "rabbitmq": publisher}, prefix=db.prefix, config=config
    )
    store = OutboxStore(db.prefix)
    try:
        relay.drain(timeout=30)
        write(db, 50, topic="a")  # a second round adds to this hour's counters
        relay.drain(timeout=30)
    finally:
        relay.close()

    assert len(publisher.published_ids()) == 650
    with db.engine.connect() as connection:
        left = connection.execute(select(func.count()).select_from(store.table)).scalar()
    assert left == 0, "published rows are deleted"
    status = db.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 650)
    published = {(d.broker, d.destination): d.published for d in status.destinations}
    assert published == {("kafka", "a"): 350, ("kafka", "b"): 200, ("rabbitmq", "ex"): 100}
    cli = outbox_status_data(db.engine, db.prefix)
    assert cli["published"] == 650

    # Retention: counters of hours older than the retention go with the purge.
    with db.engine.begin() as connection:
        connection.execute(
            update(store.counts)
            .where(store.counts.c.destination == "a")
            .values(hour=utcnow() - timedelta(days=8))
        )
    assert store.purge(db.engine, timedelta(days=7)) == 0  # no published rows to delete
    status = db.status()
    assert status.published == 300
    assert {d.destination for d in status.destinations} == {"b", "ex"}
