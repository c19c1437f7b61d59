"""FastAPI ``Idempotency-Key`` endpoints on the shared PostgreSQL (psycopg async).

One app, one table of orders (no unique constraint: only the key may prevent doubles).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from mqdedup.db.schema import schema
from mqdedup.dedup.request_keys import caller_scope
from mqdedup.fastapi import Idempotency, IdempotentRoute
from tests.services import TestDatabase, prefixed_database, table_prefix

pytestmark = pytest.mark.integration


class OrderIn(BaseModel):
    item: str
    amount: int


@dataclass
class Shop:
    """The app under test and what it wrote."""

    db: TestDatabase
    orders: Table
    engine: AsyncEngine
    app: FastAPI
    #: Set to let held requests (``item == "hold"``) finish.
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def count(self, table: Table, **where: str) -> int:
        async with self.engine.connect() as connection:
            statement = select(func.count()).select_from(table)
            for name, value in where.items():
                statement = statement.where(table.c[name] == value)
            return int((await connection.execute(statement)).scalar_one())


def build_app(prefix: str, orders: Table, engine: AsyncEngine, release: asyncio.Event) -> FastAPI:
    # ``caller`` is a dependency: here the X-User header (your authentication in real life).
    idempotency = Idempotency(
        async_sessionmaker(engine, expire_on_commit=False), caller=user, prefix=prefix
    )
    router = APIRouter(route_class=IdempotentRoute)
    flaky_failures = [1]  # "flaky" fails once, then succeeds

    @router.post("/orders", status_code=201)
    async def place_order(
        order: OrderIn, session: AsyncSession = idempotency.session
    ) -> JSONResponse:
        row = await session.execute(
            insert(orders).values(item=order.item, amount=order.amount).returning(orders.c.id)
        )
        order_id = row.scalar_one()
        if order.item == "hold":
            await asyncio.wait_for(release.wait(), timeout=20)
        if order.item == "flaky" and flaky_failures[0] > 0:
            flaky_failures[0] -= 1
            raise RuntimeError("the endpoint failed once after its write")
        if order.item == "boom":
            raise RuntimeError("the endpoint failed after its write")
        if order.item == "missing":
            raise HTTPException(404, "no such item")
        if order.item == "unavailable":
            return JSONResponse({"error": "stock service down"}, status_code=503)
        return JSONResponse(
            {"id": order_id, "item": order.item},
            status_code=201,
            headers={"Location": f"/orders/{order_id}", "Set-Cookie": "s=1"},
        )

    app = FastAPI()
    app.include_router(router)
    return app


async def user(x_user: str = Header("anonymous")) -> str:
    return x_user


@pytest.fixture
def shop(pg_url: str) -> Iterator[Shop]:
    prefix = table_prefix()
    business = MetaData()
    orders = Table(
        f"{prefix}orders",
        business,
        Column("id", Integer, primary_key=True),
        Column("item", String(64), nullable=False),
        Column("amount", Integer, nullable=False),
    )
    with prefixed_database(pg_url, "PostgreSQL", business, prefix=prefix) as db:
        engine = create_async_engine(pg_url, pool_size=10, max_overflow=10)
        release = asyncio.Event()
        yield Shop(db, orders, engine, build_app(prefix, orders, engine, release), release)


@asynccontextmanager
async def client(shop: Shop) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=shop.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as http:
        yield http
    await shop.engine.dispose()


def post(http: httpx.AsyncClient, body: dict[str, object], key: str | None, user: str = "alice"):
    headers = {"X-User": user}
    if key is not None:
        headers["Idempotency-Key"] = key
    return http.post("/orders", json=body, headers=headers)


def test_fifty_concurrent_requests_with_one_key(shop: Shop) -> None:
    """One effect, one stored response; the others 409 while it is in flight, then replays."""
    table = schema(shop.db.prefix).processed
    key = str(uuid.uuid4())
    body = {"item": "hold", "amount": 3}

    async def scenario() -> None:
        async with client(shop) as http:
            requests = [asyncio.create_task(post(http, body, key)) for _ in range(50)]
            # The first claim holds the key until released: the other 49 are answered at once.
            done, pending = await asyncio.wait(requests, timeout=30, return_when="FIRST_COMPLETED")
            while len(done) < 49 and pending:
                more, pending = await asyncio.wait(
                    pending, timeout=30, return_when="FIRST_COMPLETED"
                )
                assert more, "requests did not answer while the first was in flight"
                done |= more
            assert len(done) == 49
            answers = [task.result() for task in done]
            assert {answer.status_code for answer in answers} == {409}
            assert all(a.headers["retry-after"] == "1" for a in answers)
            assert await shop.count(shop.orders) == 0  # nothing committed yet
            shop.release.set()
            (held,) = pending
            first = await asyncio.wait_for(held, timeout=20)
            assert first.status_code == 201
            assert "idempotent-replayed" not in first.headers
            # Repeats after the commit: the stored response, marked, without the cookie.
            repeats = await asyncio.gather(*(post(http, body, key) for _ in range(10)))
            for repeat in repeats:
                assert repeat.status_code == 201
                assert repeat.content == first.content
                assert repeat.headers["location"] == first.headers["location"]
                assert repeat.headers["idempotent-replayed"] == "true"
                assert "set-cookie" not in repeat.headers
            assert await shop.count(shop.orders) == 1
            assert await shop.count(table, consumer_name=caller_scope("alice")) == 1

    asyncio.run(scenario())


def test_answers_for_bad_and_failed_requests(shop: Shop) -> None:
    """422 other payload, 400 missing key, failures store nothing and free the key."""
    table = schema(shop.db.prefix).processed

    async def scenario() -> None:
        async with client(shop) as http:
            placed = await post(http, {"item": "book", "amount": 1}, "k-1")
            assert placed.status_code == 201
            other = await post(http, {"item": "book", "amount": 2}, "k-1")
            assert other.status_code == 422
            assert other.headers["content-type"] == "application/problem+json"
            missing = await post(http, {"item": "book", "amount": 1}, None)
            assert missing.status_code == 400
            assert "Idempotency-Key" in json.loads(missing.content)["detail"]
            # Another caller's key of the same name is its own key.
            bob = await post(http, {"item": "book", "amount": 2}, "k-1", user="bob")
            assert bob.status_code == 201
            assert await shop.count(shop.orders) == 2

            for item, status in (("boom", 500), ("missing", 404), ("unavailable", 503)):
                failed = await post(http, {"item": item, "amount": 1}, f"k-{item}")
                assert failed.status_code == status
                assert await shop.count(shop.orders, item=item) == 0
                assert await shop.count(table, message_id=f"k-{item}") == 0
            # The key of a failed request is free: the client's retry runs, once.
            flaky = {"item": "flaky", "amount": 1}
            assert (await post(http, flaky, "k-flaky")).status_code == 500
            assert await shop.count(table, message_id="k-flaky") == 0
            retried = await post(http, flaky, "k-flaky")
            assert retried.status_code == 201
            assert (await post(http, flaky, "k-flaky")).headers["idempotent-replayed"] == "true"
            assert await shop.count(shop.orders, item="flaky") == 1
            fixed_key = await post(http, {"item": "pen", "amount": 1}, "k-unavailable")
            assert fixed_key.status_code == 201
            assert await shop.count(shop.orders) == 4

    asyncio.run(scenario())
