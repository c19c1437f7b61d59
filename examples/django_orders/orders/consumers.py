"""Shipment consumers: each ``order-placed`` event creates one ``Shipment`` with the ORM.

``manage.py mqdedup_worker orders.consumers:KafkaShipments`` (or ``RabbitShipments``).
The ORM write, the message's claim and the ``shipment-created`` outbox row commit in
one transaction of Django's ``default`` database.
"""

from typing import Any, ClassVar

from django.conf import settings

from mqdedup import Context, Message, MessageError
from mqdedup.kafka import KafkaConsumer
from mqdedup.rabbitmq import RabbitMQConsumer
from orders.models import Shipment


def create_shipment(message: Message, ctx: Context) -> dict[str, Any]:
    event = message.json()
    if not isinstance(event, dict) or "order" not in event:
        raise MessageError("not an order-placed event")
    shipment = Shipment.objects.create(order_id=int(event["order"]), message_id=message.id)
    ctx.outbox.publish(
        {"event": "shipment-created", "order": event["order"], "shipment": shipment.pk},
        topic=settings.SHIPMENTS_TOPIC,
        key=str(event["order"]),
    )
    return {"shipment": shipment.pk}


class KafkaShipments(KafkaConsumer):
    table_prefix = settings.MQDEDUP["TABLE_PREFIX"]  # where migrate created mqdedup's tables
    topics = (settings.ORDERS_TOPIC,)
    group_id = "shipments"
    batch_size = 100
    poll_timeout = 0.2
    kafka_config: ClassVar[dict[str, Any]] = {
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
    }

    def handle(self, message: Message, ctx: Context) -> Any:
        return create_shipment(message, ctx)


class RabbitShipments(RabbitMQConsumer):
    table_prefix = settings.MQDEDUP["TABLE_PREFIX"]
    queue = settings.ORDERS_QUEUE
    batch_size = 100
    poll_timeout = 0.2

    def handle(self, message: Message, ctx: Context) -> Any:
        return create_shipment(message, ctx)
