"""Shared test parts: a business table, consumers that write to it, and counting helpers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, insert, select

from mqdedup import Consumer, Context, Message
from mqdedup.consumers.context import BatchContext
from mqdedup.db import init_schema
from mqdedup.db.schema import schema

business = MetaData()
# Deliberately no unique constraint on message_id: only mqdedup's dedup may prevent doubles.
orders = Table(
    "test_orders",
    business,
    Column("row_id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", String(255), nullable=False),
    Column("order_id", String(64), nullable=True),
    Column("amount", Integer, nullable=True),
)


@cache
def orders_table(prefix: str) -> Table:
    """``<prefix>orders``: one row per handled message of a test with its own prefix.

    Deliberately no unique constraint on message_id: only mqdedup's dedup may prevent
    doubles. ``worker`` names the worker that wrote the row (tests with several).
    """
    return Table(
        f"{prefix}orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("body", String(2000), nullable=True),
        Column("worker", String(64), nullable=True),
    )


class OrderConsumer(Consumer):
    """Writes one order row per message; fails for ids listed in ``fail_ids``."""

    name = "orders"
    batch_size = 100
    poll_timeout = 0.05
    fail_ids: frozenset[str] = frozenset()

    def handle(self, message: Message, ctx: Context) -> Any:
        payload = message.json()
        ctx.session.execute(
            insert(orders).values(
                message_id=message.id,
                order_id=str(payload.get("order")),
                amount=payload.get("amount"),
            )
        )
        if message.id in self.fail_ids:
            raise RuntimeError(f"cannot handle {message.id}")
        return {"order": payload.get("order"), "status": "accepted"}


class BulkOrderConsumer(OrderConsumer):
    """The same effects through one INSERT per batch."""

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> dict[str, Any]:
        rows = []
        for message in messages:
            payload = message.json()
            if message.id in self.fail_ids:
                raise RuntimeError(f"cannot handle {message.id}")
            rows.append(
                {
                    "message_id": message.id,
                    "order_id": str(payload.get("order")),
                    "amount": payload.get("amount"),
                }
            )
        ctx.session.execute(insert(orders), rows)
        return {}


def order_counts(engine: Engine) -> dict[str, int]:
    """Business rows per message id."""
    with engine.connect() as connection:
        rows = connection.execute(
            select(orders.c.message_id, func.count()).group_by(orders.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


class Gate:
    """A latch a handler can wait on (bounded), to hold a transaction open in a test."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self, timeout: float = 30.0) -> None:
        self.entered.set()
        if not self.release.wait(timeout):
            raise TimeoutError("gate was never released")


def reset_database(engine: Engine) -> None:
    """Drop and recreate the framework's and the tests' tables (unprefixed)."""
    business.drop_all(engine)
    schema().metadata.drop_all(engine)
    init_schema(engine)
    business.create_all(engine)
