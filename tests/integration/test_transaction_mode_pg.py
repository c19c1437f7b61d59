"""Transaction mode on real PostgreSQL: one ordinary Session transaction per message.

``failure_isolation = "transaction"`` claims, handles and commits each message on its
own. Every handler style answers as its statements (reads, generated keys, rowcounts,
savepoints, the outbox), a write PostgreSQL refuses fails only its message (retried,
then dead-lettered), a refused claim fails only the claimed message, and a duplicate
gets its stored result.
"""

from __future__ import annotations

import json
import random
import threading
from typing import Any, ClassVar

import psycopg
import pytest
from sqlalchemy import Engine, event, make_url, text
from sqlalchemy.orm import registry

from mqdedup import InMemoryBroker, Message, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import schema
from mqdedup.outbox.notify import channel_name
from tests.integration.rabbitmq.support import claims, order_counts
from tests.integration.test_handler_writes_pg import Mixed, results
from tests.services import TestDatabase
from tests.support import orders_table

pytestmark = pytest.mark.integration

#: The claim of this id is refused by a trigger (a data error, SQLSTATE 22023).
REFUSED = "plain-30"


class PerMessage(Mixed):
    """The deferred-writes test's handler kinds, one transaction per message, plus an
    outbox message per message and a record of the duplicates' stored results."""

    failure_isolation = "transaction"
    batch_size = 100
    row_class: ClassVar[type[Any]]

    def __init__(self) -> None:
        self.duplicates: dict[str, Any] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        result = super().handle(message, ctx)
        if message.json()["kind"] == "stage":  # a staged row, written before the commit
            ctx.stage(self.orders, {"message_id": f"{message.id}-staged", "body": "s"})
        if message.json()["kind"] == "orm":  # an ORM object, flushed in the transaction
            ctx.session.add(self.row_class(message_id=f"{message.id}-orm", body="o"))
        if message.json()["kind"] == "outbox":
            ctx.outbox.publish({"order": message.id}, topic="events", message_id=f"ev-{message.id}")
        return result

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        assert message.id is not None
        self.duplicates[message.id] = stored_result


def refuse_claim(db: TestDatabase, message_id: str) -> None:
    processed = schema(db.prefix).processed.name
    with db.engine.begin() as connection:
        connection.execute(
            text(
                f"CREATE FUNCTION {db.prefix}refuse() RETURNS trigger AS $$ BEGIN "
                f"IF NEW.message_id = '{message_id}' THEN RAISE EXCEPTION 'refused' "
                "USING ERRCODE = '22023'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        connection.execute(
            text(
                f"CREATE TRIGGER {db.prefix}refuse BEFORE INSERT ON {processed} "
                f"FOR EACH ROW EXECUTE FUNCTION {db.prefix}refuse()"
            )
        )


def test_every_answer_is_kept_and_only_the_culprit_fails(
    db: TestDatabase,
) -> None:
    orders = orders_table(db.prefix)
    row_class = type("Row", (), {})
    registry().map_imperatively(row_class, orders)
    attributes = {"orders": orders, "table_prefix": db.prefix, "row_class": row_class}
    consumer = type("T", (PerMessage,), attributes)()
    refuse_claim(db, REFUSED)
    through_sqlalchemy: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith(f"INSERT INTO {orders.name}"):
            through_sqlalchemy.append(statement)

    kinds = ["plain"] * 100
    kinds[10], kinds[20], kinds[40], kinds[50] = "key", "read", "upsert", "count"
    kinds[60], kinds[70], kinds[71] = "catch", "outbox", "outbox"
    kinds[90], kinds[91] = "stage", "orm"
    kinds[80] = "bad"  # VARCHAR(2000) refuses its row: fails in the one query
    broker = InMemoryBroker()
    ids = []
    for number, kind in enumerate(kinds):
        ids.append(f"{kind}-{number}")
        broker.publish("q", json.dumps({"kind": kind}), message_id=ids[-1])
    # Copies of messages with stored results, in the next batch, back to back.
    for message_id in ("key-10", "read-20", "catch-60", "plain-0", "key-10"):
        broker.publish("q", json.dumps({"kind": "plain"}), message_id=message_id)
    dsn = make_url(db.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {channel_name(db.prefix)}")
        metrics = run_until_idle(consumer, broker.transport("q"), db.engine)
        woken = list(listener.notifies(timeout=5, stop_after=1))

    good = [i for i in ids if i not in ("bad-80", REFUSED)]
    counts = order_counts(db.engine, orders)
    assert {i: counts.get(i) for i in good} == dict.fromkeys(good, 1)
    assert "bad-80" not in counts and REFUSED not in counts
    assert counts["stage-90-staged"] == 1 and counts["orm-91-orm"] == 1
    assert claims(db.engine, db.prefix, consumer.consumer_name) == set(good)
    # Both culprits: tried twice (max_attempts=2), then dead-lettered; nothing else failed.
    assert metrics.dead_lettered == 2 and metrics.failures == 4
    assert metrics.processed == len(good) and metrics.duplicates == 5
    stored = results(db)
    assert stored["key-10"] == {"row_id": _row_id(db, "key-10")}
    assert stored["read-20"] == {"own": 1, "all": 21}  # its own row and all before it
    assert stored["upsert-40"] == {"rowcount": 1}
    assert stored["count-50"] == {"rowcount": 1, "many": 1}
    assert stored["catch-60"] == {"caught": True}
    assert consumer.duplicates == {
        "key-10": stored["key-10"],
        "read-20": stored["read-20"],
        "catch-60": {"caught": True},
        "plain-0": None,
    }
    outbox = schema(db.prefix).outbox
    with db.engine.connect() as connection:
        events = connection.execute(text(f"SELECT message_id FROM {outbox.name}")).scalars()
        assert sorted(events) == ["ev-outbox-70", "ev-outbox-71"]
    assert woken  # the relay's wake-up went out with the outbox rows' commit
    # Every statement went through SQLAlchemy when the handler called it.
    assert len(through_sqlalchemy) >= 100


def _row_id(db: TestDatabase, message_id: str) -> int:
    with db.engine.connect() as connection:
        value = connection.execute(
            text(f"SELECT row_id FROM {db.prefix}orders WHERE message_id = :id"),
            {"id": message_id},
        ).scalar_one()
    return int(value)


class Terminating(PerMessage):
    """Message ``kill-5``'s first handler call ends its own database session from
    another connection: its next statement finds the connection dead."""

    engine: ClassVar[Engine]

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        self.calls[message.id] = self.calls.get(message.id, 0) + 1
        if message.id == "kill-5" and self.calls[message.id] == 1:
            pid = ctx.session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with self.engine.connect() as admin:
                admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        return super().handle(message, ctx)


def test_a_connection_lost_mid_message_is_waited_out_and_each_effect_stays_once(
    db: TestDatabase,
) -> None:
    orders = orders_table(db.prefix)
    attributes = {"orders": orders, "table_prefix": db.prefix, "engine": db.engine}
    consumer = type("K", (Terminating,), attributes)()
    broker = InMemoryBroker()
    ids = [f"{kind}-{number}" for number, kind in enumerate(["plain"] * 5 + ["kill"] + ["key"] * 4)]
    for message_id in ids:
        broker.publish("q", json.dumps({"kind": message_id.split("-")[0]}), message_id=message_id)
    metrics = run_until_idle(consumer, broker.transport("q"), db.engine)

    assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
    assert claims(db.engine, db.prefix, consumer.consumer_name) == set(ids)
    assert consumer.calls["kill-5"] == 2  # its transaction died with the connection
    assert metrics.database_retries >= 1 and metrics.failures == 0
    assert metrics.processed == len(ids) and metrics.dead_lettered == 0


def test_workers_racing_for_the_same_ids_write_each_effect_once(db: TestDatabase) -> None:
    """Each worker's transaction holds one claim at a time (it commits before it claims
    the next message), so racing workers wait on each other, never deadlock."""
    orders = orders_table(db.prefix)
    ids = [f"plain-{number}" for number in range(300)]
    workers = []
    for seed in range(3):
        broker = InMemoryBroker()
        for message_id in random.Random(seed).sample(ids, len(ids)):
            broker.publish("q", json.dumps({"kind": "plain"}), message_id=message_id)
        attributes = {"orders": orders, "table_prefix": db.prefix, "batch_size": 50}
        consumer = type("R", (PerMessage,), attributes)()
        workers.append(Worker(consumer, broker.transport("q"), db.engine))
    threads = [threading.Thread(target=w.run, kwargs={"until_idle": True}) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)

    assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
    assert sum(worker.metrics.processed for worker in workers) == len(ids)
    assert sum(worker.metrics.duplicates for worker in workers) == 2 * len(ids)
