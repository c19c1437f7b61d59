"""The order consumer: ``mqdedup worker examples.order_service.consumer:OrderConsumer``.

For every new order it inserts a row into ``<EXAMPLE_TABLE_PREFIX>orders`` and writes an
``order-accepted`` event to the outbox, in the transaction that also claims the
message id. ``mqdedup relay`` publishes the event to Kafka after the commit.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from sqlalchemy import insert

from examples import settings
from examples.order_service import config
from mqdedup import Context, Message, MessageError, RetryPolicy
from mqdedup.kafka import KafkaConsumer


class OrderConsumer(KafkaConsumer):
    """Accepts orders from Kafka; one transaction per batch of up to 200 messages."""

    topics = (config.orders_topic(),)
    group_id = config.group_id()
    table_prefix = settings.mqdedup_prefix()
    batch_size = 200
    poll_timeout = 0.5
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.2)
    # Short group timeouts: a killed worker's partitions move on within ~6 s.
    kafka_config: ClassVar[dict[str, Any]] = {
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
    }

    def handle(self, message: Message, ctx: Context) -> Any:
        """Insert the order and its ``order-accepted`` event; return the event id."""
        order = message.json()  # malformed JSON: dead-lettered to <topic>.DLT with the reason
        try:
            order_id = str(order["order_id"])
            customer = str(order["customer"])
            total = Decimal(str(order["total"]))
        except (KeyError, TypeError, InvalidOperation) as error:
            raise MessageError(f"invalid order: {type(error).__name__}: {error}") from error
        if total <= 0:
            # A MessageError is the message's own fault: dead-lettered at once, no retries.
            raise MessageError(f"invalid order {order_id}: total must be positive")
        ctx.session.execute(
            insert(config.orders_table()).values(
                order_id=order_id,
                customer=customer,
                total=total,
                message_id=message.id,
                created_at=datetime.now(UTC),
            )
        )
        event_id = ctx.outbox.publish(
            {"event": "order-accepted", "order_id": order_id, "total": str(total)},
            topic=config.events_topic(),
            key=order_id,  # events of one order keep their order
        )
        return {"status": "accepted", "event_id": event_id}
