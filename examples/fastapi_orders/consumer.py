"""The shipping consumer: an async consumer of the ``order-placed`` events, run in the app.

It runs inside the FastAPI app (``app.py``'s lifespan) on the app's event loop; it could
equally run alone: ``mqdedup worker examples.fastapi_orders.consumer:Shipping``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert

from examples import settings
from examples.fastapi_orders import config
from mqdedup import AsyncContext, Message, MessageError
from mqdedup.kafka import AsyncKafkaConsumer


class Shipping(AsyncKafkaConsumer):
    """Writes one shipment per placed order: claim, shipment row, commit, offset commit."""

    topics = (config.events_topic(),)
    group_id = config.shipping_group()
    table_prefix = settings.mqdedup_prefix()
    batch_size = 100
    poll_timeout = 0.5

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        """Insert the order's shipment; return its order id (stored with the claim)."""
        event = message.json()
        if event.get("event") != "order-placed":
            raise MessageError(f"not an order-placed event: {event.get('event')!r}")
        _orders, shipments = config.tables()
        await ctx.session.execute(
            insert(shipments).values(
                order_id=int(event["order_id"]),
                message_id=message.id,
                created_at=datetime.now(UTC),
            )
        )
        return {"order_id": event["order_id"]}
