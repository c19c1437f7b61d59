"""The FastAPI order service: ``POST /orders`` with an ``Idempotency-Key``, shipping in the app.

``POST /orders`` writes the order and its ``order-placed`` event (the outbox) in one
transaction, which also claims the request's ``Idempotency-Key`` and stores the
response: a client that retries (same key, same body) gets the first response back
(``Idempotent-Replayed: true``) and the order is placed once. ``mqdedup relay``
publishes the events; the :class:`~examples.fastapi_orders.consumer.Shipping` consumer
runs inside the app (its lifespan) and writes one shipment per order.

With uvicorn installed: ``uvicorn examples.fastapi_orders.app:app``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Depends, FastAPI, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from examples import settings
from examples.fastapi_orders import config
from examples.fastapi_orders.consumer import Shipping
from mqdedup import AsyncOutboxWriter, create_async_engine
from mqdedup.fastapi import Idempotency, IdempotentRoute, consumers_health, consumers_lifespan


class OrderIn(BaseModel):
    """What a client orders."""

    item: str = Field(min_length=1, max_length=128)
    quantity: int = Field(gt=0)


class OrderOut(BaseModel):
    """The placed order."""

    id: int
    customer: str
    item: str
    quantity: int


#: The ``Authorization: Bearer <token>`` header (401 without it).
BEARER = Depends(HTTPBearer())


async def customer(credentials: HTTPAuthorizationCredentials = BEARER) -> str:
    """Who is calling, from a signed bearer token (``config.customer_token``): the
    idempotency keys are scoped to it, so no customer can replay another's orders."""
    who = config.token_customer(credentials.credentials)
    if who is None:
        raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
    return who


def create_app(engine: AsyncEngine | None = None) -> FastAPI:
    """The app on ``engine`` (default: ``MQDEDUP_DATABASE_URL`` through psycopg async)."""
    engine = engine or create_async_engine(settings.database_url())
    prefix = settings.mqdedup_prefix()
    orders, _shipments = config.tables()
    idempotency = Idempotency(
        async_sessionmaker(engine, expire_on_commit=False), caller=customer, prefix=prefix
    )
    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/orders", status_code=201)
    async def place_order(
        order: OrderIn,
        who: str = Depends(customer),
        session: AsyncSession = idempotency.session,
    ) -> OrderOut:
        """Place an order: its row and its ``order-placed`` event commit with the key."""
        placed = await session.execute(
            insert(orders)
            .values(
                customer=who,
                item=order.item,
                quantity=order.quantity,
                created_at=datetime.now(UTC),
            )
            .returning(orders.c.id)
        )
        order_id = placed.scalar_one()
        await AsyncOutboxWriter(session, prefix=prefix).publish(
            {"event": "order-placed", "order_id": order_id, "item": order.item},
            topic=config.events_topic(),
            key=str(order_id),
            message_id=f"order-placed-{order_id}",
        )
        return OrderOut(id=order_id, customer=who, item=order.item, quantity=order.quantity)

    app = FastAPI(
        title="orders", lifespan=consumers_lifespan(Shipping(), database=engine, stop_timeout=20)
    )
    app.include_router(router)
    app.include_router(consumers_health())
    return app


app = create_app()
