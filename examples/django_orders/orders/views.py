"""``POST /orders/``: the order and its ``order-placed`` event in one transaction.

Clients authenticate with a bearer token (``orders.auth``) and send an
``Idempotency-Key``: a retried request gets the first one's response
(``Idempotent-Replayed: true``) and places no second order. The keys are the
authenticated user's (``@idempotent``'s default scope): another user's request with the
same key is a request of its own; an anonymous one gets 403.
"""

import json
from decimal import Decimal, InvalidOperation

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from mqdedup.django import idempotent, outbox
from orders.models import Order


@csrf_exempt  # authenticated by a bearer token, not a cookie: no CSRF to fear
@require_POST
@idempotent
@transaction.atomic
def place_order(request: HttpRequest) -> HttpResponse:
    try:
        data = json.loads(request.body)
        customer = str(data["customer"])
        total = Decimal(str(data["total"]))
    except (ValueError, KeyError, TypeError, InvalidOperation):
        return JsonResponse({"error": "expected JSON with customer and total"}, status=400)
    order = Order.objects.create(customer=customer, total=total)
    event = {"event": "order-placed", "order": order.pk, "total": str(total)}
    writer = outbox()
    # The same event id for Kafka and RabbitMQ: each is a copy of one event.
    event_id = f"order-{order.pk}-placed"
    writer.publish(event, topic=settings.ORDERS_TOPIC, key=str(order.pk), message_id=event_id)
    writer.publish(
        event,
        exchange="",
        routing_key=settings.ORDERS_QUEUE,
        key=str(order.pk),
        message_id=event_id + "-amqp",
    )
    return JsonResponse({"order": order.pk, "event": event_id}, status=201)
