"""Names of the FastAPI order service's topic, group and tables (environment overrides)."""

from __future__ import annotations

import hashlib
import hmac
import os
from functools import cache

from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table

from examples import settings


def events_topic() -> str:
    """The topic the relay publishes ``order-placed`` events to."""
    return os.environ.get("API_ORDER_EVENTS_TOPIC", "example-api-order-events")


def token_secret() -> bytes:
    """The key the API tokens are signed with (``API_TOKEN_SECRET``; a real service keeps
    it in its secret store)."""
    return os.environ.get("API_TOKEN_SECRET", "example-only-token-secret").encode()


def customer_token(customer: str) -> str:
    """The bearer token of ``customer``: ``<customer>.<HMAC-SHA256 of it>`` (what the
    service's login would hand out; the demo clients mint their own)."""
    signature = hmac.new(token_secret(), customer.encode(), hashlib.sha256).hexdigest()
    return f"{customer}.{signature}"


def token_customer(token: str) -> str | None:
    """The customer a bearer token was issued to, None for a forged or malformed one."""
    customer, _, signature = token.rpartition(".")
    expected = hmac.new(token_secret(), customer.encode(), hashlib.sha256).hexdigest()
    return customer if customer and hmac.compare_digest(signature, expected) else None


def shipping_group() -> str:
    """The shipping consumer's Kafka group, also its dedup scope (consumer name)."""
    return os.environ.get("API_SHIPPING_GROUP", "example-api-shipping")


@cache
def tables(prefix: str | None = None) -> tuple[Table, Table]:
    """``<prefix>api_orders`` (one row per placed order) and ``<prefix>shipments``.

    Deliberately no unique constraints: only the idempotency keys and the consumer's
    dedup keep each order and each shipment once (the report checks it).
    """
    prefix = prefix if prefix is not None else settings.business_prefix()
    metadata = MetaData()
    orders = Table(
        f"{prefix}api_orders",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("customer", String(128), nullable=False),
        Column("item", String(128), nullable=False),
        Column("quantity", Integer, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    shipments = Table(
        f"{prefix}shipments",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("order_id", Integer, nullable=False, index=True),
        Column("message_id", String(255), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    return orders, shipments
