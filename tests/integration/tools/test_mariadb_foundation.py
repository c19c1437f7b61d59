"""The foundation's promises, and the outbox's rollback, on a real MariaDB.

Every test runs twice: with MariaDB's one-statement claim (``INSERT IGNORE … RETURNING``)
and with the two-statement claim used on MySQL, which has no ``RETURNING``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text

from mqdedup import InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import BatchContext, Context
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import schema
from mqdedup.errors import SimulatedCrash
from tests.integration.tools.conftest import Database, lock_waiters
from tests.services import wait_for
from tests.support import Gate

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture(params=["returning", "rowcount"])
def claim_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """MariaDB's RETURNING claim, or the MySQL claim decided by INSERT IGNORE row counts."""
    if request.param == "rowcount":
        monkeypatch.setattr(
            "mqdedup.db.dialects.claims.mysql_supports_returning", lambda _dialect: False
        )
    yield request.param


def order_consumer(db: Database, *, bulk: bool = False, **attributes: Any) -> Consumer:
    """A consumer writing one row per message into this test's own orders table."""
    orders = db.business.orders

    class Orders(Consumer):
        name = "orders"
        batch_size = 500
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        table_prefix = db.prefix
        fail_ids: frozenset[str] = frozenset()

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(
                insert(orders).values(message_id=message.id, order_id=str(message.json()["order"]))
            )
            if message.id in self.fail_ids:
                raise RuntimeError(f"cannot handle {message.id}")
            return {"order": message.json()["order"]}

    class BulkOrders(Orders):
        def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> dict[str, Any]:
            ctx.session.execute(
                insert(orders),
                [{"message_id": m.id, "order_id": str(m.json()["order"])} for m in messages],
            )
            return {}

    chosen = BulkOrders if bulk else Orders
    for key, value in attributes.items():
        setattr(chosen, key, value)
    return chosen()


def publish_orders(broker: InMemoryBroker, count: int) -> None:
    for number in range(count):
        broker.publish("orders", json.dumps({"order": number}), message_id=f"m{number}")


@pytest.mark.parametrize("bulk", [False, True], ids=["handle", "handle_batch"])
def test_4k_deliveries_with_30pct_duplicates_write_each_order_once(
    mariadb: Database, claim_path: str, bulk: bool
) -> None:
    broker = InMemoryBroker(seed=7)
    publish_orders(broker, 4_000)
    copies = broker.inject_duplicates("orders", 0.3)
    assert 1_000 < copies < 1_400

    metrics = run_until_idle(
        order_consumer(mariadb, bulk=bulk), broker.transport("orders"), mariadb.engine
    )

    counts = mariadb.business.order_counts(mariadb.engine)
    assert len(counts) == 4_000 and set(counts.values()) == {1}
    assert (metrics.processed, metrics.duplicates) == (4_000, copies)
    assert mariadb.count(schema(mariadb.prefix).processed) == 4_000


@pytest.mark.parametrize("holder_fails", [False, True], ids=["holder-commits", "holder-fails"])
def test_two_workers_racing_on_one_message_id_write_one_row(
    mariadb: Database, claim_path: str, holder_fails: bool
) -> None:
    """The second claim waits on the holder's key; it then sees a duplicate (holder
    committed) or claims and processes the message itself (holder rolled back)."""
    gate = Gate()
    base = order_consumer(mariadb)

    class Holder(type(base)):  # type: ignore[misc]
        retry_policy = RetryPolicy(max_attempts=1)

        def handle(self, message: Message, ctx: Context) -> Any:
            result = super().handle(message, ctx)
            gate.hold()
            if holder_fails:
                raise RuntimeError("holder's handler failed after the claim")
            return result

    # Each worker gets the same message (a redelivery to two consumers at once), with
    # a batch-mate so that the claim statement covers a new id and a contested one.
    holder_broker, second_broker = InMemoryBroker(), InMemoryBroker()
    holder_broker.publish("orders", b'{"order": "race"}', message_id="race-1")
    second_broker.publish("orders", b'{"order": 0}', message_id="other-1")
    second_broker.publish("orders", b'{"order": "race"}', message_id="race-1")
    metrics: dict[str, Any] = {}

    def run(role: str, consumer: Consumer, broker: InMemoryBroker) -> None:
        metrics[role] = run_until_idle(consumer, broker.transport("orders"), mariadb.engine)

    holder = threading.Thread(target=run, args=("holder", Holder(), holder_broker))
    second = threading.Thread(target=run, args=("second", base, second_broker))
    holder.start()
    try:
        assert gate.entered.wait(30), "the holder never entered its handler"
        second.start()
        processed_table = schema(mariadb.prefix).processed.name
        wait_for(
            lambda: lock_waiters(mariadb.engine, processed_table) >= 1,
            30,
            "the second worker's claim to wait on the holder's key",
        )
        assert second.is_alive()
    finally:
        gate.release.set()
    holder.join(timeout=60)
    second.join(timeout=60)
    assert not holder.is_alive() and not second.is_alive()

    counts = mariadb.business.order_counts(mariadb.engine)
    assert counts == {"race-1": 1, "other-1": 1}
    if holder_fails:
        assert metrics["holder"].dead_lettered == 1 and metrics["holder"].processed == 0
        assert (metrics["second"].processed, metrics["second"].duplicates) == (2, 0)
    else:
        assert metrics["holder"].processed == 1
        assert (metrics["second"].processed, metrics["second"].duplicates) == (1, 1)


def test_failing_handler_rolls_back_its_outbox_rows(mariadb: Database, claim_path: str) -> None:
    """The outbox rollback promise on MariaDB: a failing handler leaves no outbox row,
    no business row and no claim; its batch-mates commit theirs exactly once."""
    orders = mariadb.business.orders
    outbox = schema(mariadb.prefix).outbox

    class Publishing(type(order_consumer(mariadb))):  # type: ignore[misc]
        fail_ids = frozenset({"m3", "m17"})

        def handle(self, message: Message, ctx: Context) -> Any:
            ctx.session.execute(insert(orders).values(message_id=message.id, order_id="x"))
            ctx.outbox.publish({"accepted": message.id}, topic="order-events", key=message.id)
            if message.id in self.fail_ids:
                raise RuntimeError(f"cannot handle {message.id}")
            return None

    broker = InMemoryBroker(seed=3)
    publish_orders(broker, 50)
    copies = broker.inject_duplicates("orders", 0.3)
    metrics = run_until_idle(Publishing(), broker.transport("orders"), mariadb.engine)

    with mariadb.engine.connect() as connection:
        outbox_rows = dict(
            connection.execute(
                select(outbox.c.message_key, func.count()).group_by(outbox.c.message_key)
            ).all()
        )
        failed_claims = connection.execute(
            text(
                f"SELECT count(*) FROM {schema(mariadb.prefix).processed.name} "
                "WHERE message_id IN ('m3', 'm17')"
            )
        ).scalar_one()
        attempts = dict(
            connection.execute(
                text(f"SELECT message_id, attempts FROM {schema(mariadb.prefix).attempts.name}")
            ).all()
        )
    expected = {f"m{n}".encode() for n in range(50)} - {b"m3", b"m17"}
    assert set(outbox_rows) == expected
    assert set(outbox_rows.values()) == {1}
    counts = mariadb.business.order_counts(mariadb.engine)
    assert set(counts) == {f"m{n}" for n in range(50)} - {"m3", "m17"}
    assert set(counts.values()) == {1}
    assert failed_claims == 0
    assert attempts == {"m3": 3, "m17": 3}  # counted with ON DUPLICATE KEY UPDATE
    dead = {d.message.header("message-id") for d in broker.dead_letters["orders"]}
    assert dead == {"m3", "m17"}
    assert metrics.processed == 48
    assert metrics.delivered == 50 + copies


def test_message_ids_differing_only_in_case_are_distinct(
    mariadb: Database, claim_path: str
) -> None:
    """MariaDB's default collations ignore case and trailing spaces; dedup keys must not."""
    broker = InMemoryBroker()
    for message_id in ("Order-1", "order-1", "ORDER-1", "order-1 ", "Ordér-1"):
        broker.publish("orders", b'{"order": 1}', message_id=message_id)
    broker.publish("orders", b'{"order": 1}', message_id="order-1")  # a true duplicate

    metrics = run_until_idle(order_consumer(mariadb), broker.transport("orders"), mariadb.engine)

    assert (metrics.processed, metrics.duplicates) == (5, 1)
    assert mariadb.business.order_counts(mariadb.engine) == {
        "Order-1": 1,
        "order-1": 1,
        "ORDER-1": 1,
        "order-1 ": 1,
        "Ordér-1": 1,
    }


def test_crash_after_commit_is_not_applied_twice(mariadb: Database, claim_path: str) -> None:
    crashes: list[int] = []

    class Crashing(type(order_consumer(mariadb))):  # type: ignore[misc]
        batch_size = 100

        def after_commit(self, messages: Sequence[Message]) -> None:
            if len(crashes) < 3:
                crashes.append(len(messages))
                raise SimulatedCrash("killed between commit and ack")

    broker = InMemoryBroker()
    publish_orders(broker, 1_000)
    while broker.pending("orders"):
        worker = Worker(Crashing(), broker.transport("orders"), mariadb.engine)
        with contextlib.suppress(SimulatedCrash):
            worker.run(until_idle=True)
    assert len(crashes) == 3
    counts = mariadb.business.order_counts(mariadb.engine)
    assert len(counts) == 1_000 and set(counts.values()) == {1}
