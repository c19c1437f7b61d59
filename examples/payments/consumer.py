"""The payment consumer: ``mqdedup worker examples.payments.consumer:PaymentConsumer``.

Payment events arrive on a RabbitMQ queue: ``authorized`` creates the payment,
``captured`` / ``refunded`` / ``voided`` move it with a conditional state transition.
The ledger entry of a capture or refund is written only when the transition *applied*.

Two layers of protection:

* mqdedup's dedup (the AMQP ``message_id``) skips redeliveries and producer retries of
  the same message;
* the state transition catches what the dedup cannot see: the payment provider sending
  the same event again under a *new* message id (a webhook retry), and late or stale
  events (a ``captured`` that arrives after the refund is ``rejected``, never applied).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from examples import settings
from examples.payments import config
from mqdedup import Context, Message, MessageError, RetryPolicy
from mqdedup.dedup.transitions import TransitionOutcome
from mqdedup.rabbitmq import RabbitMQConsumer

TARGETS = {"captured": config.CAPTURED, "refunded": config.REFUNDED, "voided": config.VOIDED}
LEDGER_ENTRIES = {config.CAPTURED: ("capture", 1), config.REFUNDED: ("refund", -1)}


class PaymentNotYetKnownError(Exception):
    """The event is ahead of the payment's state (out of order): retry it later."""


class PaymentConsumer(RabbitMQConsumer):
    """Applies payment events; each event's effects commit with its dedup claim."""

    queue = config.payments_queue()
    table_prefix = settings.mqdedup_prefix()
    batch_size = 100
    poll_timeout = 0.5
    # Out-of-order events (a capture before its authorization, with several workers)
    # are retried with backoff; after 6 attempts they go to <queue>.dlq.
    retry_policy = RetryPolicy(max_attempts=6, initial_backoff=0.2, max_backoff=2.0)

    def handle(self, message: Message, ctx: Context) -> Any:
        """Apply one payment event; return the outcome (stored with the claim)."""
        event = message.json()
        try:
            kind = str(event["event"])
            payment_id = str(event["payment_id"])
        except (KeyError, TypeError) as error:
            raise MessageError(f"invalid payment event: missing {error}") from error
        if kind == "authorized":
            return self._authorize(event, payment_id, message, ctx)
        target = TARGETS.get(kind)
        if target is None:
            raise MessageError(f"invalid payment event: unknown event {kind!r}")
        result = config.payment_flow().transition(
            ctx.session, payment_id, to=target, values={"updated_at": datetime.now(UTC)}
        )
        if result.applied and target in LEDGER_ENTRIES:
            entry, sign = LEDGER_ENTRIES[target]
            self._ledger(ctx, payment_id, entry, sign, message)
        elif result.outcome is TransitionOutcome.NOT_FOUND or (
            result.rejected
            and result.current_state is not None
            and config.reachable(result.current_state, target)
        ):
            # Ahead of its time: the authorization / capture has not been applied yet.
            raise PaymentNotYetKnownError(f"{payment_id}: {kind} before its prerequisite")
        elif result.rejected:
            ctx.log.warning("payment event rejected", extra={"outcome": str(result)})
        return {"payment_id": payment_id, "event": kind, "outcome": str(result)}

    def _authorize(
        self, event: dict[str, Any], payment_id: str, message: Message, ctx: Context
    ) -> Any:
        try:
            amount = Decimal(str(event["amount"]))
            order_id = str(event["order_id"])
        except (KeyError, InvalidOperation) as error:
            raise MessageError(f"invalid authorization: {type(error).__name__}: {error}") from error
        payments, _ = config.tables()
        # A second authorization of the same payment (a new message id) changes nothing.
        created = ctx.session.execute(
            pg_insert(payments)
            .values(
                payment_id=payment_id,
                order_id=order_id,
                amount=amount,
                status=config.AUTHORIZED,
                version=1,
                updated_at=datetime.now(UTC),
            )
            .on_conflict_do_nothing(index_elements=["payment_id"])
            .returning(payments.c.payment_id)
        ).first()
        outcome = "applied" if created is not None else "already in target state"
        return {"payment_id": payment_id, "event": "authorized", "outcome": outcome}

    def _ledger(
        self, ctx: Context, payment_id: str, entry: str, sign: int, message: Message
    ) -> None:
        payments, ledger = config.tables()
        amount = ctx.session.execute(
            select(payments.c.amount).where(payments.c.payment_id == payment_id)
        ).scalar_one()
        ctx.session.execute(
            insert(ledger).values(
                payment_id=payment_id,
                entry=entry,
                amount=amount * sign,
                message_id=message.id,
                created_at=datetime.now(UTC),
            )
        )
