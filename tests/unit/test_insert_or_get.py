"""``insert_or_get`` on SQLite: inserted / existing, Table and ORM class, the consumer's
``ctx.insert_or_get`` (sync, batch and async), and clear errors for wrong arguments."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    event,
    func,
    insert,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from mqdedup import (
    AsyncConsumer,
    AsyncContext,
    Consumer,
    Context,
    InMemoryBroker,
    InsertOrGet,
    InsertOrGetError,
    Message,
    RetryPolicy,
    async_insert_or_get,
    insert_or_get,
    run_until_idle,
)
from mqdedup.consumers.context import BatchContext
from mqdedup.consumers.worker import Worker
from mqdedup.db.async_engine import create_async_engine
from tests.support import order_counts, orders

metadata = MetaData()
customers = Table(
    "io_customers",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("email", String(255), nullable=False, unique=True),
    Column("name", String(64), nullable=False),
    Column("tier", String(16), nullable=False, server_default="basic"),
)
stock = Table(
    "io_stock",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tenant", String(64), nullable=False),
    Column("sku", String(64), nullable=False),
    Column("region", String(8), nullable=True),
    Column("quantity", Integer, nullable=False),
    UniqueConstraint("tenant", "sku"),
    Index("io_stock_region", "region", "sku", unique=True, sqlite_where=Column("region") != ""),
)


class Base(DeclarativeBase):
    metadata = metadata


class Product(Base):
    __tablename__ = "io_products"
    id: Mapped[int] = mapped_column(primary_key=True)
    code: Mapped[str] = mapped_column(String(32), unique=True, index=True)
    title: Mapped[str] = mapped_column(String(64))


@pytest.fixture
def engine(sqlite_engine: Engine) -> Iterator[Engine]:
    metadata.create_all(sqlite_engine)
    yield sqlite_engine
    metadata.drop_all(sqlite_engine)


def count(engine: Engine, table: Table) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def test_inserts_then_gets_the_stored_row_with_its_defaults(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        first = insert_or_get(session, customers, {"email": "a@x", "name": "Ann"}, key="email")
        again = insert_or_get(session, customers, {"email": "a@x", "name": "Bob"}, key=["email"])
        other = insert_or_get(session, customers, {"email": "b@x", "name": "Bea"}, key=["email"])
    assert first.inserted and not first.existed
    assert first.row.id == 1 and first.row.tier == "basic"  # generated key, server default
    assert again == InsertOrGet(first.row, inserted=False) and again.existed
    assert again.row.name == "Ann"  # the stored row, not the one offered
    assert other.inserted and other.row.id == 2
    assert count(engine, customers) == 2


def test_a_plain_connection_composite_keys_and_the_primary_key(engine: Engine) -> None:
    with engine.begin() as connection:
        rows = [("t1", "s1", 1), ("t1", "s2", 2), ("t2", "s1", 3), ("t1", "s1", 4)]
        found = [
            insert_or_get(
                connection,
                stock,
                {"tenant": t, "sku": s, "quantity": q},
                key=["sku", "tenant"],  # any order of the constraint's columns
            )
            for t, s, q in rows
        ]
        by_id = insert_or_get(
            connection, stock, {"id": 2, "tenant": "t9", "sku": "s9", "quantity": 0}, key="id"
        )
    assert [f.inserted for f in found] == [True, True, True, False]
    assert found[3].row.quantity == 1 and found[3].row == found[0].row
    assert by_id.existed and by_id.row.sku == "s2"
    assert count(engine, stock) == 3


def test_sql_expressions_among_the_values(engine: Engine) -> None:
    with engine.begin() as connection:
        first = insert_or_get(
            connection, customers, {"email": "a@x", "name": func.upper("ann")}, key="email"
        )
        again = insert_or_get(
            connection, customers, {"email": "a@x", "name": func.lower("X")}, key="email"
        )
        with pytest.raises(InsertOrGetError, match="'email' need a plain value"):
            insert_or_get(
                connection, customers, {"email": func.lower("A@X"), "name": "x"}, key="email"
            )
    assert first.inserted and first.row.name == "ANN"
    assert again.existed and again.row == first.row


def test_an_orm_class_and_its_pending_objects(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.add(Product(code="p1", title="pending"))  # not flushed yet
        found = insert_or_get(session, Product, {"code": "p1", "title": "new"}, key="code")
        made = insert_or_get(session, Product, {"code": "p2", "title": "new"}, key="code")
    assert found.existed and found.row.title == "pending"
    assert made.inserted and made.row.code == "p2"


@pytest.mark.parametrize(
    ("target", "row", "key", "message"),
    [
        (
            "customers",
            {"email": "a"},
            "email",
            "needs a Table or an ORM mapped class, not 'customers'",
        ),
        (object, {"email": "a"}, "email", "needs a Table or an ORM mapped class"),
        (
            customers,
            {"email": "a", "name": "n"},
            "name",
            r"key \(name\) is not a unique key of the table "
            r"\(declared unique keys: \(id\); \(email\)\)",
        ),
        (
            stock,
            {"tenant": "t", "sku": "s", "quantity": 1},
            "tenant",
            r"io_stock: key \(tenant\) is not a unique key",
        ),
        # A partial unique index cannot be an ON CONFLICT target.
        (
            stock,
            {"region": "eu", "sku": "s", "tenant": "t", "quantity": 1},
            ["region", "sku"],
            r"key \(region, sku\) is not a unique key",
        ),
        (customers, {"name": "n"}, "email", "the row has no value for key column\\(s\\) 'email'"),
        (customers, {"email": None, "name": "n"}, "email", "no value for key column"),
        (
            customers,
            {"email": "a", "nmae": "n"},
            "email",
            "no column 'nmae' \\(columns: id, email, name, tier\\)",
        ),
        (customers, {"email": "a"}, "mail", "no column 'mail'"),
        (customers, {"email": "a"}, [], "key must name one or more columns, not \\[\\]"),
        (customers, {"email": "a"}, [customers.c.email], "key must name one or more columns"),
        (
            customers,
            [("email", "a")],
            "email",
            "row must be a mapping of column names to values, not list",
        ),
    ],
)
def test_wrong_arguments_are_refused_before_any_sql(
    engine: Engine, target: Any, row: Any, key: Any, message: str
) -> None:
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(InsertOrGetError, match=message),
    ):
        insert_or_get(session, target, row, key=key)
    assert not [s for s in statements if "io_" in s]


class Signups(Consumer):
    """An order row, then the customer got or created, then a second order row."""

    name = "signups"
    poll_timeout = 0.01
    batch_size = 20
    retry_policy = RetryPolicy(max_attempts=1)

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(insert(orders).values(message_id=message.id, amount=1))
        email = message.json()["email"]
        found = ctx.insert_or_get(customers, {"email": email, "name": str(message.id)}, key="email")
        ctx.session.execute(insert(orders).values(message_id=message.id, amount=2))
        return {"inserted": found.inserted, "id": found.row.id}


class BulkSignups(Consumer):
    name = "bulk-signups"
    poll_timeout = 0.01
    batch_size = 20

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> dict[str, Any]:
        out = {}
        for m in messages:
            found = ctx.insert_or_get(
                customers, {"email": m.json()["email"], "name": str(m.id)}, key="email"
            )
            out[str(m.id)] = {"inserted": found.inserted, "id": found.row.id}
        return out


class AsyncSignups(AsyncConsumer):
    name = "async-signups"
    poll_timeout = 0.01
    batch_size = 20

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        await ctx.session.execute(insert(orders).values(message_id=message.id, amount=1))
        email = message.json()["email"]
        found = await ctx.insert_or_get(
            customers, {"email": email, "name": str(message.id)}, key="email"
        )
        return {"inserted": found.inserted, "id": found.row.id}


EMAILS = {"m0": "a@x", "m1": "a@x", "m2": "b@x", "m3": "a@x"}


def stored_results(engine: Engine) -> dict[str, Any]:
    from mqdedup.db.schema import schema

    processed = schema().processed
    with engine.connect() as connection:
        return dict(connection.execute(select(processed.c.message_id, processed.c.result)).all())


def publish(broker: InMemoryBroker) -> None:
    for message_id, email in EMAILS.items():
        broker.publish("q", json.dumps({"email": email}), message_id=message_id)


@pytest.mark.parametrize(
    "consumer", [Signups(), BulkSignups(), AsyncSignups()], ids=["handle", "handle_batch", "async"]
)
def test_ctx_insert_or_get_in_every_kind_of_handler(engine: Engine, consumer: Consumer) -> None:
    broker = InMemoryBroker()
    publish(broker)
    if isinstance(consumer, AsyncConsumer):

        async def run() -> None:
            async_engine = create_async_engine(engine)
            try:
                await Worker(consumer, broker.transport("q"), async_engine).run_async(
                    until_idle=True
                )
            finally:
                await async_engine.dispose()

        asyncio.run(run())
    else:
        run_until_idle(consumer, broker.transport("q"), engine)

    assert not broker.dead_letters and broker.pending("q") == 0
    results = stored_results(engine)
    assert [results[m]["inserted"] for m in EMAILS] == [True, False, True, False]
    assert [results[m]["id"] for m in EMAILS] == [1, 1, 2, 1]
    assert count(engine, customers) == 2
    if isinstance(consumer, Signups):
        assert order_counts(engine) == dict.fromkeys(EMAILS, 2)


def test_async_insert_or_get_on_an_async_session(engine: Engine) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    async def run() -> list[InsertOrGet]:
        async_engine = create_async_engine(engine)
        try:
            async with AsyncSession(async_engine) as session, session.begin():
                return [
                    await async_insert_or_get(
                        session, customers, {"email": "a@x", "name": n}, key="email"
                    )
                    for n in ("first", "second")
                ]
        finally:
            await async_engine.dispose()

    first, second = asyncio.run(run())
    assert first.inserted and second.existed and second.row == first.row
