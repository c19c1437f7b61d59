"""The payment service's queue, tables and state machine (environment overrides)."""

from __future__ import annotations

import os
from functools import cache

from sqlalchemy import Column, DateTime, Integer, MetaData, Numeric, String, Table

from examples import settings
from mqdedup.dedup.transitions import StateMachine

AUTHORIZED = "AUTHORIZED"
CAPTURED = "CAPTURED"
REFUNDED = "REFUNDED"
VOIDED = "VOIDED"

#: The allowed moves of a payment's status.
EDGES = {AUTHORIZED: {CAPTURED, VOIDED}, CAPTURED: {REFUNDED}}


def payments_queue() -> str:
    """The queue payment events arrive on; also the dedup scope (consumer name)."""
    return os.environ.get("PAYMENTS_QUEUE", "example-payments")


@cache
def tables(prefix: str | None = None) -> tuple[Table, Table]:
    """``<prefix>payments`` (one row per payment) and ``<prefix>ledger`` (money moved)."""
    prefix = prefix if prefix is not None else settings.business_prefix()
    metadata = MetaData()
    payments = Table(
        f"{prefix}payments",
        metadata,
        Column("payment_id", String(64), primary_key=True),
        Column("order_id", String(64), nullable=False),
        Column("amount", Numeric(12, 2), nullable=False),
        Column("status", String(16), nullable=False),
        Column("version", Integer, nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
    )
    # No unique constraint on (payment_id, entry) on purpose: the report shows that the
    # state machine alone keeps each capture / refund once.
    ledger = Table(
        f"{prefix}ledger",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("payment_id", String(64), nullable=False, index=True),
        Column("entry", String(16), nullable=False),
        Column("amount", Numeric(12, 2), nullable=False),
        Column("message_id", String(255), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    return payments, ledger


@cache
def payment_flow() -> StateMachine:
    """AUTHORIZED → CAPTURED → REFUNDED, or AUTHORIZED → VOIDED."""
    payments, _ = tables()
    return StateMachine(payments, EDGES, state_column="status", version_column="version")


def reachable(source: str, target: str) -> bool:
    """True when ``target`` can still be reached from ``source`` along the edges."""
    seen: set[str] = set()
    todo = [source]
    while todo:
        state = todo.pop()
        for following in EDGES.get(state, ()):
            if following == target:
                return True
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return False
