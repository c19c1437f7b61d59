"""Names of the order service's topics, group and tables (environment overrides)."""

from __future__ import annotations

import os
from functools import cache

from sqlalchemy import Column, DateTime, Integer, MetaData, Numeric, String, Table

from examples import settings


def orders_topic() -> str:
    """The topic the orders arrive on."""
    return os.environ.get("ORDERS_TOPIC", "example-orders")


def events_topic() -> str:
    """The topic the relay publishes ``order-accepted`` events to."""
    return os.environ.get("ORDER_EVENTS_TOPIC", "example-order-events")


def group_id() -> str:
    """The Kafka consumer group, also the dedup scope (consumer name)."""
    return os.environ.get("ORDERS_GROUP", "example-order-service")


@cache
def orders_table(prefix: str | None = None) -> Table:
    """``<prefix>orders``: one row per accepted order.

    There is deliberately no unique constraint on ``order_id``, so the report shows that
    mqdedup alone keeps each order once. In production add one as a second line of
    defence.
    """
    name = f"{prefix if prefix is not None else settings.business_prefix()}orders"
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("order_id", String(64), nullable=False, index=True),
        Column("customer", String(128), nullable=False),
        Column("total", Numeric(12, 2), nullable=False),
        Column("message_id", String(255), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
