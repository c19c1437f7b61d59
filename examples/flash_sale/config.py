"""The flash sale's queues, tables, order state machine and gateway (environment overrides)."""

from __future__ import annotations

import os
from functools import cache

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table

from examples import settings
from mqdedup.dedup.transitions import StateMachine

RESERVED = "RESERVED"
PAID = "PAID"
CANCELLED = "CANCELLED"
SHIPPED = "SHIPPED"

#: An order is placed RESERVED (stock taken), then PAID, and later SHIPPED; a reserved
#: order whose payment is refused is CANCELLED.
EDGES = {RESERVED: {PAID, CANCELLED}, PAID: {SHIPPED}}
PRICE_CENTS = 1999


def orders_queue() -> str:
    """Where placed orders go (the outbox relay publishes them); the payment consumer's
    queue and dedup scope."""
    return os.environ.get("FLASH_SALE_QUEUE", "example-flash-sale-orders")


def events_queue() -> str:
    """Where the paid orders' events go."""
    return os.environ.get("FLASH_SALE_EVENTS_QUEUE", "example-flash-sale-events")


def gateway_url() -> str:
    """The payment API (``python -m examples.flash_sale.gateway`` runs a fake one)."""
    return os.environ.get("FLASH_SALE_GATEWAY", "http://127.0.0.1:8099")


@cache
def tables(prefix: str | None = None) -> tuple[Table, Table]:
    """``<prefix>stock`` (units left per SKU) and ``<prefix>sale_orders``."""
    prefix = prefix if prefix is not None else settings.business_prefix()
    metadata = MetaData()
    stock = Table(
        f"{prefix}stock",
        metadata,
        Column("sku", String(64), primary_key=True),
        Column("initial", Integer, nullable=False),
        Column("available", Integer, nullable=False),
        #: The highest lock token that wrote the row (the fenced-lock strategy only).
        Column("fence_token", BigInteger, nullable=True),
    )
    orders = Table(
        f"{prefix}sale_orders",
        metadata,
        Column("order_id", String(36), primary_key=True),
        Column("user_id", String(64), nullable=False),
        Column("sku", String(64), nullable=False),
        Column("quantity", Integer, nullable=False),
        Column("status", String(16), nullable=False),
        Column("version", Integer, nullable=False),
        Column("charge_id", String(64), nullable=True),
    )
    return stock, orders


@cache
def order_flow() -> StateMachine:
    """RESERVED -> PAID -> SHIPPED, or RESERVED -> CANCELLED."""
    _, orders = tables()
    return StateMachine(orders, EDGES, state_column="status", version_column="version")
