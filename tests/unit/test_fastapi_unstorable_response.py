"""An endpoint under ``Idempotency`` that returns a streaming response (its body cannot be
stored with the key) answers the documented ``application/problem+json`` 500, and commits
nothing: no order, no key (issue #40)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.request_keys import SHARED_SCOPE
from mqdedup.fastapi import Idempotency, IdempotentRoute
from mqdedup.fastapi.idempotency import RESPONSE_NOT_STORABLE
from tests.support import orders


def count(engine: Engine, table: Any) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def test_a_streaming_response_answers_problem_json_and_commits_nothing(
    sqlite_engine: Engine,
) -> None:
    async def scenario() -> list[httpx.Response]:
        engine = create_async_engine(sqlite_engine)
        idempotency = Idempotency(async_sessionmaker(engine), caller=SHARED_SCOPE)
        router = APIRouter(route_class=IdempotentRoute)

        @router.post("/orders")
        async def place(
            body: dict[str, str], session: AsyncSession = idempotency.session
        ) -> StreamingResponse:
            await session.execute(insert(orders).values(message_id=body["id"]))

            async def chunks() -> AsyncIterator[bytes]:
                yield b"placed"

            return StreamingResponse(chunks(), media_type="text/plain")

        app = FastAPI()
        app.include_router(router)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                return [
                    await http.post("/orders", json={"id": "1"}, headers={"Idempotency-Key": "k"})
                    for _ in range(2)
                ]
        finally:
            await engine.dispose()

    for answer in asyncio.run(scenario()):  # the key was free again for the second
        assert answer.status_code == 500
        assert answer.headers["content-type"] == "application/problem+json"
        problem = json.loads(answer.content)
        assert problem["type"] == RESPONSE_NOT_STORABLE and problem["status"] == 500
        assert "StreamingResponse" in problem["detail"]
    assert count(sqlite_engine, orders) == 0
    assert count(sqlite_engine, schema().processed) == 0
