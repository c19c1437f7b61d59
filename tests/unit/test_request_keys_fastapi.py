"""mqdedup.fastapi on SQLite (aiosqlite) and the in-memory broker: keys, lifespan, health."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from mqdedup import AsyncConsumer, AsyncContext, InMemoryBroker, Message
from mqdedup.consumers.memory import MemoryTransport
from mqdedup.consumers.metrics import Metrics
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.request_keys import SHARED_SCOPE
from mqdedup.errors import ConfigurationError
from mqdedup.fastapi import (
    ConsumerTasks,
    Idempotency,
    IdempotentRoute,
    consumers_health,
    consumers_lifespan,
)
from mqdedup.stopping import StopToken
from tests.support import OrderConsumer, orders

QUEUE = "app-orders"


def count(engine: Engine, table: Any) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def keyed_app(engine: AsyncEngine, route_class: type[Any] = IdempotentRoute) -> FastAPI:
    idempotency = Idempotency(async_sessionmaker(engine), caller=SHARED_SCOPE)
    router = APIRouter(route_class=route_class)

    @router.post("/orders", status_code=201)
    async def place(body: dict[str, str], session: AsyncSession = idempotency.session) -> Any:
        await session.execute(insert(orders).values(message_id=body["id"]))
        return {"placed": body["id"]}

    app = FastAPI()
    app.include_router(router)
    return app


async def post(app: FastAPI, key: str, body: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
        return await http.post("/orders", json=body, headers={"Idempotency-Key": key})


def test_keys_on_sqlite_replay_and_refuse_other_payloads(sqlite_engine: Engine) -> None:
    async def scenario() -> list[httpx.Response]:
        engine = create_async_engine(sqlite_engine)
        app = keyed_app(engine)
        try:
            return [
                await post(app, "k", {"id": "1"}),
                await post(app, "k", {"id": "1"}),
                await post(app, "k", {"id": "2"}),
            ]
        finally:
            await engine.dispose()

    first, repeat, other = asyncio.run(scenario())
    assert first.status_code == 201 and repeat.status_code == 201
    assert repeat.content == first.content
    assert repeat.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert count(sqlite_engine, orders) == 1


def test_without_the_route_class_nothing_commits(sqlite_engine: Engine) -> None:
    """A misconfigured router answers 500 naming the fix; no order, no key."""

    async def scenario() -> httpx.Response:
        engine = create_async_engine(sqlite_engine)
        try:
            return await post(keyed_app(engine, APIRouter().route_class), "k", {"id": "1"})
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()).status_code == 500
    assert count(sqlite_engine, orders) == 0
    assert count(sqlite_engine, schema().processed) == 0


class Shipping(AsyncConsumer):
    """Writes one order row per message, on a memory transport handed in."""

    name = "app-shipping"
    poll_timeout = 0.05

    def __init__(self, transport: MemoryTransport | None = None) -> None:
        self.transport = transport

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> MemoryTransport:
        if self.transport is None:
            raise ConfigurationError("no broker configured")
        return self.transport

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        await ctx.session.execute(insert(orders).values(message_id=message.id))
        return None


def test_lifespan_runs_consumers_reports_health_and_stops_gracefully(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    for n in range(10):
        broker.publish(QUEUE, b"{}", message_id=f"m-{n}")

    async def scenario() -> tuple[httpx.Response, httpx.Response, int]:
        engine = create_async_engine(sqlite_engine)
        app = FastAPI(
            lifespan=consumers_lifespan(Shipping(broker.transport(QUEUE)), database=engine)
        )
        app.include_router(consumers_health())
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                async with app.router.lifespan_context(app):
                    deadline = time.monotonic() + 10
                    while (health := await http.get("/healthz/consumers")).json()["consumers"][
                        "app-shipping"
                    ]["processed"] < 10:
                        assert time.monotonic() < deadline, health.json()
                        await asyncio.sleep(0.02)
                    # Delivered while the app runs: settled before the shutdown returns.
                    broker.publish(QUEUE, b"{}", message_id="m-late")
                    while broker.pending(QUEUE):
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)
                stopped = await http.get("/healthz/consumers")
            return health, stopped, broker.settled_count[QUEUE]
        finally:
            await engine.dispose()

    health, stopped, settled = asyncio.run(scenario())
    assert health.status_code == 200 and health.json()["ready"] is True
    assert stopped.status_code == 503  # stopped consumers are not running
    assert stopped.json()["consumers"]["app-shipping"]["running"] is False
    assert settled == 11
    assert count(sqlite_engine, orders) == 11


def test_a_failed_consumer_makes_health_503_and_sync_consumers_are_refused(
    sqlite_engine: Engine,
) -> None:
    async def scenario() -> httpx.Response:
        engine = create_async_engine(sqlite_engine)
        app = FastAPI()
        app.include_router(consumers_health())
        transport = httpx.ASGITransport(app=app)
        try:
            async with (
                ConsumerTasks([Shipping()], engine) as tasks,
                httpx.AsyncClient(transport=transport, base_url="http://app") as http,
            ):
                app.state.mqdedup_consumers = tasks
                deadline = time.monotonic() + 10
                while (answer := await http.get("/healthz/consumers")).json()["consumers"][
                    "app-shipping"
                ]["running"]:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                return answer
        finally:
            await engine.dispose()

    answer = asyncio.run(scenario())
    assert answer.status_code == 503
    assert "no broker configured" in answer.json()["consumers"]["app-shipping"]["error"]
    with pytest.raises(ConfigurationError, match="not an AsyncConsumer"):
        ConsumerTasks([OrderConsumer()], None)
