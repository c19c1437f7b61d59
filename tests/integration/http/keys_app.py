"""The FastAPI app the HTTP key tests serve with uvicorn (``--factory ...:create_app``).

Configured from the environment: ``KEYS_DATABASE_URL`` (a synchronous URL: PostgreSQL
through psycopg, MariaDB through PyMySQL; the async driver is picked from it) and
``KEYS_PREFIX`` (mqdedup's tables and ``<prefix>effects``). Every endpoint writes one
row to ``<prefix>effects`` per run, so a test counts effects in the database.

The caller is the ``X-User`` header, as the docs' example reads it (your authentication
in real life); without it a keyed request has no caller.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from mqdedup.db.async_engine import create_async_engine
from mqdedup.fastapi import Idempotency, IdempotentRoute
from tests.integration.http.servers import BODIES


def effects_table(prefix: str, metadata: MetaData | None = None) -> Table:
    """One row per endpoint run."""
    return Table(
        f"{prefix}effects",
        metadata or MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("kind", String(32), nullable=False),
        Column("caller", String(400), nullable=False),
        Column("detail", String(400), nullable=False),
    )


class OrderIn(BaseModel):
    item: str
    amount: int


async def current_user(x_user: str | None = Header(None)) -> str | None:
    """Who is calling (the docs' example; None without the header: no caller)."""
    return x_user


def create_app() -> FastAPI:
    """The app on ``KEYS_DATABASE_URL`` with mqdedup's tables of ``KEYS_PREFIX``."""
    prefix = os.environ["KEYS_PREFIX"]
    engine = create_async_engine(os.environ["KEYS_DATABASE_URL"], pool_size=20, max_overflow=30)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    effects = effects_table(prefix)
    idempotency = Idempotency(sessions, caller=current_user, prefix=prefix)
    canonical = Idempotency(sessions, caller=current_user, prefix=prefix, fingerprint="json")
    releases: dict[str, asyncio.Event] = {}  # held requests (item "hold-<tag>") by tag
    router = APIRouter(route_class=IdempotentRoute)

    async def effect(session: AsyncSession, kind: str, caller: str | None, detail: str) -> None:
        values = {"kind": kind, "caller": caller or "-", "detail": detail[:400]}
        await session.execute(insert(effects).values(**values))

    @router.post("/orders", status_code=201)
    async def place_order(
        order: OrderIn,
        x_user: str | None = Header(None),
        session: AsyncSession = idempotency.session,
    ) -> JSONResponse:
        await effect(session, "order", x_user, order.item)
        if order.item.startswith("hold-"):
            held = releases.setdefault(order.item[5:], asyncio.Event())
            await asyncio.wait_for(held.wait(), timeout=60)
        # What the first caller must never see leak to another: its card token, its cookie.
        token = f"tok_{secrets.token_hex(8)}"
        return JSONResponse(
            {"item": order.item, "card_token": token},
            status_code=201,
            headers={"Set-Cookie": f"session={token}", "Location": "/orders/1"},
        )

    @router.post("/binary/{kind}")
    async def binary(
        kind: str, x_user: str | None = Header(None), session: AsyncSession = idempotency.session
    ) -> Response:
        await effect(session, "binary", x_user, kind)
        return Response(BODIES[kind], media_type="application/octet-stream")

    @router.post("/view")
    async def view(
        x_user: str | None = Header(None), session: AsyncSession = idempotency.session
    ) -> Response:
        await effect(session, "view", x_user, "")
        return Response(memoryview(b"a memoryview body"), media_type="text/plain")

    @router.post("/commits")
    async def commits(
        x_user: str | None = Header(None), session: AsyncSession = idempotency.session
    ) -> dict[str, str]:
        await effect(session, "commits", x_user, "")
        await session.commit()  # misuse: the dependency owns the transaction
        return {"committed": "by the endpoint"}

    @router.post("/raw")
    async def raw(
        request: Request,
        x_user: str | None = Header(None),
        session: AsyncSession = idempotency.session,
    ) -> dict[str, Any]:
        body = await request.body()
        await effect(session, "raw", x_user, f"{len(body)}")
        return {"bytes": len(body), "n": secrets.token_hex(4)}

    @router.post("/json")
    async def json_body(
        request: Request,
        x_user: str | None = Header(None),
        session: AsyncSession = canonical.session,
    ) -> dict[str, Any]:
        await effect(session, "json", x_user, "")
        return {"n": secrets.token_hex(4)}

    @router.post("/p/{rest:path}")
    async def path_echo(
        rest: str,
        request: Request,
        x_user: str | None = Header(None),
        session: AsyncSession = idempotency.session,
    ) -> dict[str, Any]:
        body = await request.body()
        await effect(session, "path", x_user, f"{rest!r}|{request.url.query}|{body!r}")
        return {"path": rest, "query": request.url.query, "body": body.hex()}

    app = FastAPI()
    app.include_router(router)

    @app.post("/release/{tag}")
    async def release_held(tag: str) -> dict[str, bool]:
        releases.setdefault(tag, asyncio.Event()).set()
        return {"released": True}

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    return app
