"""``ctx.insert_or_get`` against real PostgreSQL and MariaDB.

Inside a real consumer's transaction (in-memory transport): a key found in the batch or
committed earlier is answered with the stored row, no statement fails, and every
batch-mate's writes commit (the scenario the hand-written "insert, catch
IntegrityError" loses on PostgreSQL). Concurrently: workers on separate connections
inserting the same key while its first inserter is still in flight create one row and
all get it, whether that inserter commits or rolls back.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    func,
    insert,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from mqdedup import (
    AsyncConsumer,
    AsyncContext,
    Consumer,
    InMemoryBroker,
    InsertOrGet,
    InsertOrGetError,
    Message,
    RetryPolicy,
    insert_or_get,
    run_until_idle,
)
from mqdedup.consumers.context import Context
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import MYSQL_TABLE_OPTIONS, KeyString, schema
from mqdedup.dedup import unique_keys
from mqdedup.dedup.transitions import run_transaction
from tests.integration.tools.conftest import Database, lock_waiters
from tests.services import wait_for

pytestmark = pytest.mark.integration

WORKERS = 8


def tables(prefix: str) -> tuple[MetaData, Table, Table]:
    metadata = MetaData()
    customers = Table(
        f"{prefix}customers",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("email", KeyString(255), nullable=False, unique=True),
        Column("name", String(64), nullable=False),
        Column("tier", String(16), nullable=False, server_default="basic"),
        **MYSQL_TABLE_OPTIONS,
    )
    stock = Table(
        f"{prefix}stock",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("tenant", KeyString(64), nullable=False),
        Column("sku", KeyString(64), nullable=False),
        Column("quantity", Integer, nullable=False),
        UniqueConstraint("tenant", "sku"),
        **MYSQL_TABLE_OPTIONS,
    )
    return metadata, customers, stock


@pytest.fixture
def own(database: Database) -> Iterator[tuple[Database, Table, Table]]:
    metadata, customers, stock = tables(f"{database.prefix}io_")
    metadata.create_all(database.engine)
    try:
        yield database, customers, stock
    finally:
        metadata.drop_all(database.engine)


class Signups(Consumer):
    """Writes an order row, gets or creates the customer, writes a second order row."""

    name = "signups"
    batch_size = 50
    poll_timeout = 0.01
    retry_policy = RetryPolicy(max_attempts=1, initial_backoff=0.001, max_backoff=0.01)
    customers: ClassVar[Table]
    orders: ClassVar[Table]

    def handle(self, message: Message, ctx: Context) -> Any:
        email = message.json()["email"]
        ctx.session.execute(insert(self.orders).values(message_id=message.id, order_id="before"))
        found = ctx.insert_or_get(
            self.customers, {"email": email, "name": str(message.id)}, key=["email"]
        )
        ctx.session.execute(insert(self.orders).values(message_id=message.id, order_id="after"))
        row = found.row
        return {"inserted": found.inserted, "id": row.id, "name": row.name, "tier": row.tier}


class AsyncSignups(AsyncConsumer):
    """:class:`Signups` as an async consumer: ``await ctx.insert_or_get(...)``."""

    name = "signups"
    batch_size = 50
    poll_timeout = 0.01
    retry_policy = RetryPolicy(max_attempts=1, initial_backoff=0.001, max_backoff=0.01)
    customers: ClassVar[Table]
    orders: ClassVar[Table]

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        email = message.json()["email"]
        orders = self.orders
        await ctx.session.execute(insert(orders).values(message_id=message.id, order_id="before"))
        found = await ctx.insert_or_get(
            self.customers, {"email": email, "name": str(message.id)}, key=["email"]
        )
        await ctx.session.execute(insert(orders).values(message_id=message.id, order_id="after"))
        row = found.row
        return {"inserted": found.inserted, "id": row.id, "name": row.name, "tier": row.tier}


def run_consumer(consumer: Consumer, broker: InMemoryBroker, engine: Engine) -> Metrics:
    if not isinstance(consumer, AsyncConsumer):
        return run_until_idle(consumer, broker.transport("q"), engine)

    async def run() -> Metrics:
        async_engine = create_async_engine(engine)
        try:
            worker = Worker(consumer, broker.transport("q"), async_engine)
            return await worker.run_async(until_idle=True)
        finally:
            await async_engine.dispose()

    return asyncio.run(run())


@pytest.mark.parametrize("kind", [Signups, AsyncSignups], ids=["sync", "async"])
def test_in_a_consumer_batch_the_stored_row_is_returned_and_every_write_commits(
    own: tuple[Database, Table, Table], kind: type[Consumer]
) -> None:
    database, customers, _ = own
    orders = database.business.orders
    with database.engine.begin() as connection:
        connection.execute(insert(customers).values(email="z@x", name="committed", tier="gold"))
    consumer = type(
        "S", (kind,), {"customers": customers, "orders": orders, "table_prefix": database.prefix}
    )()
    broker = InMemoryBroker()
    emails = {"m0": "a@x", "m1": "a@x", "m2": "b@x", "m3": "a@x", "m4": "z@x"}
    for message_id, email in emails.items():
        broker.publish("q", json.dumps({"email": email}), message_id=message_id)

    metrics = run_consumer(consumer, broker, database.engine)

    assert metrics.processed == 5 and metrics.failures == 0 and not broker.dead_letters
    # Every message's two order rows committed, the key's batch-mates' included.
    assert database.business.order_counts(database.engine) == dict.fromkeys(emails, 2)
    with database.engine.connect() as connection:
        stored = {r.email: r for r in connection.execute(select(customers)).all()}
        processed = schema(database.prefix).processed
        results = dict(connection.execute(select(processed.c.message_id, processed.c.result)).all())
    assert {email: row.name for email, row in stored.items()} == {
        "a@x": "m0",
        "b@x": "m2",
        "z@x": "committed",
    }
    assert [results[m]["inserted"] for m in emails] == [True, False, True, False, False]
    for message_id, email in emails.items():  # the stored row, its defaults and key
        row = stored[email]
        assert results[message_id] == {
            "inserted": results[message_id]["inserted"],
            "id": row.id,
            "name": row.name,
            "tier": row.tier,
        }
    assert results["m0"]["tier"] == "basic" and results["m4"]["tier"] == "gold"


def test_composite_keys_and_a_key_that_is_not_unique(own: tuple[Database, Table, Table]) -> None:
    database, _, stock = own

    def work(session: Session) -> list[InsertOrGet]:
        rows = [("t1", "s1", 1), ("t1", "s2", 2), ("t2", "s1", 3), ("t1", "s1", 4)]
        return [
            insert_or_get(
                session, stock, {"tenant": t, "sku": s, "quantity": q}, key=("tenant", "sku")
            )
            for t, s, q in rows
        ]

    found = run_transaction(database.engine, work)
    assert [f.inserted for f in found] == [True, True, True, False]
    assert found[3].row == found[0].row and found[3].row.quantity == 1
    with Session(database.engine) as session, session.begin():
        with pytest.raises(InsertOrGetError, match=rf"{stock.name}: key \(tenant\) is not"):
            insert_or_get(
                session, stock, {"tenant": "t1", "sku": "s9", "quantity": 0}, key="tenant"
            )
        # Nothing ran: the transaction is still usable.
        again = insert_or_get(
            session, stock, {"tenant": "t1", "sku": "s2", "quantity": 9}, key=["sku", "tenant"]
        )
        assert again.existed and again.row.quantity == 2
    with database.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(stock)).scalar_one() == 3


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_concurrent_workers_inserting_one_key_create_one_row(
    own: tuple[Database, Table, Table], first_ends: str
) -> None:
    """The first inserter holds the key uncommitted until the others wait on it."""
    database, customers, _ = own
    email = f"{uuid.uuid4().hex[:8]}@x"
    results: list[InsertOrGet] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(number: int) -> None:
        def work(session: Session) -> InsertOrGet:
            return insert_or_get(
                session, customers, {"email": email, "name": f"w{number}"}, key=["email"]
            )

        try:
            found = run_transaction(database.engine, work, attempts=20)
            with lock:
                results.append(found)
        except BaseException as error:
            with lock:
                errors.append(error)

    with Session(database.engine) as first:
        first.begin()
        held = insert_or_get(first, customers, {"email": email, "name": "first"}, key="email")
        assert held.inserted
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
        for thread in threads:
            thread.start()
        wait_for(
            lambda: lock_waiters(database.engine, customers.name) >= WORKERS,
            30,
            "every worker waiting on the first inserter's key",
        )
        if first_ends == "commit":
            first.commit()
        else:
            first.rollback()
        for thread in threads:
            thread.join(60)

    assert not errors
    assert len(results) == WORKERS
    with database.engine.connect() as connection:
        rows = connection.execute(select(customers).where(customers.c.email == email)).all()
    assert len(rows) == 1
    [row] = rows
    assert {found.row for found in results} == {row}  # every caller got the stored row
    inserted = [found for found in results if found.inserted]
    if first_ends == "commit":
        assert row.name == "first" and not inserted
    else:
        assert len(inserted) == 1 and inserted[0].row.name == row.name


def test_a_row_committed_after_the_snapshot_is_found_under_repeatable_read(
    own: tuple[Database, Table, Table],
) -> None:
    """PostgreSQL reports it as a serialization failure (the transaction is rerun);
    MariaDB answers the duplicate key with a locking read of the latest committed row."""
    database, customers, _ = own
    engine = database.engine.execution_options(isolation_level="REPEATABLE READ")
    attempts: list[int] = []

    def work(session: Session) -> InsertOrGet:
        attempts.append(1)
        session.execute(select(func.count()).select_from(customers)).scalar_one()  # snapshot
        if len(attempts) == 1:
            with database.engine.begin() as other:
                other.execute(insert(customers).values(email="rr@x", name="other"))
        return insert_or_get(session, customers, {"email": "rr@x", "name": "mine"}, key="email")

    found = run_transaction(engine, work)

    assert found.existed and found.row.name == "other"
    assert len(attempts) == (2 if database.engine.dialect.name == "postgresql" else 1)


@pytest.mark.parametrize("database", ["mariadb"], indirect=True)
def test_mysql_without_returning_reads_its_own_insert_back(
    own: tuple[Database, Table, Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MySQL has no ``INSERT … RETURNING``: the inserted row is read back (MariaDB here,
    made to take MySQL's path)."""
    database, customers, _ = own
    monkeypatch.setattr(unique_keys, "mysql_supports_returning", lambda _dialect: False)
    unique_keys._statements.cache_clear()
    try:
        with Session(database.engine) as session, session.begin():
            first = insert_or_get(session, customers, {"email": "m@x", "name": "a"}, key="email")
            again = insert_or_get(session, customers, {"email": "m@x", "name": "b"}, key="email")
    finally:
        unique_keys._statements.cache_clear()
    assert first.inserted and first.row.tier == "basic" and first.row.id > 0
    assert again.existed and again.row == first.row


def test_a_row_breaking_another_unique_key_raises_as_a_plain_insert(
    own: tuple[Database, Table, Table],
) -> None:
    """Only the key's conflict is answered; MariaDB's transaction goes on after it."""
    database, customers, _ = own
    with Session(database.engine) as session, session.begin():
        first = insert_or_get(session, customers, {"email": "a@x", "name": "a"}, key="email")
        taken_id = {"id": first.row.id, "email": "new@x", "name": "b"}
        with pytest.raises(IntegrityError):
            insert_or_get(session, customers, taken_id, key="email")
        if database.engine.dialect.name == "postgresql":
            session.rollback()  # the failed statement aborted PostgreSQL's transaction
            return
        later = insert_or_get(session, customers, {"email": "c@x", "name": "c"}, key="email")
    assert later.inserted
    with database.engine.connect() as connection:
        emails = set(connection.execute(select(customers.c.email)).scalars())
    assert emails == {"a@x", "c@x"}
