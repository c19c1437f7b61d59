"""The payment consumer: ``mqdedup worker examples.flash_sale.consumer:SalePayments``.

A placed order arrives from the outbox; the handler charges it through ``ctx.step``
and moves the order ``RESERVED -> PAID`` with a conditional state transition, writing
the ``order paid`` event to the outbox, all in the message's transaction.

What keeps the charge once:

* mqdedup's dedup (the message id) skips a redelivery of a message already committed;
* ``ctx.step("charge", ...)`` records the gateway's answer in its own short
  transaction, so a rerun of the handler (a crash before the commit, a retry after a
  later error) reuses it instead of calling again;
* the step's idempotency key, sent as the ``Idempotency-Key`` header and the merchant
  order number, covers the one window the record cannot: a crash after the gateway
  charged and before the record committed. The rerun calls again with the same key and
  the gateway answers with the same charge;
* the state transition makes a late or repeated event for an order already paid (or
  cancelled) change nothing.
"""

from __future__ import annotations

from typing import Any

from examples import settings
from examples.flash_sale import config, gateway
from mqdedup import Context, Message, RetryPolicy
from mqdedup.rabbitmq import RabbitMQConsumer


class SalePayments(RabbitMQConsumer):
    """Charges each placed order once and marks it paid."""

    queue = config.orders_queue()
    table_prefix = settings.mqdedup_prefix()
    batch_size = 50
    retry_policy = RetryPolicy(max_attempts=5, initial_backoff=0.2, max_backoff=5)

    def handle(self, message: Message, ctx: Context) -> Any:
        order = message.json()
        charged = ctx.step("charge", lambda key: gateway.charge(config.gateway_url(), key, order))
        result = config.order_flow().transition(
            ctx.session, order["order_id"], config.PAID, values={"charge_id": charged["charge_id"]}
        )
        if result.applied:
            ctx.outbox.publish(
                {"order_id": order["order_id"], "status": "paid", "charge": charged["charge_id"]},
                exchange="",
                routing_key=config.events_queue(),
            )
        return {"outcome": str(result.outcome), "charge_id": charged["charge_id"]}
