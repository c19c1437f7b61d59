"""The example's own tests: pytest-django's test database, mqdedup's test kit.

Run from this folder: ``pytest --ds=orders_project.settings tests``.
"""

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from orders.auth import token_for
from orders.consumers import RabbitShipments
from orders.models import Order, Shipment

from mqdedup import Context, Message, RetryPolicy
from mqdedup.django import outbox
from mqdedup.django.conf import table_prefix


def count(table: str) -> int:
    """Rows of one of mqdedup's tables (``outbox``, ``processed_messages``)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table_prefix()}{table}")
        return int(cursor.fetchone()[0])


def order(client: Client, key: str | None, customer: str = "ada", user: str | None = "ada") -> Any:
    headers = {"Idempotency-Key": key} if key is not None else {}
    if user is not None:
        account = User.objects.get_or_create(username=user)[0]
        headers["Authorization"] = f"Bearer {token_for(account)}"
    return client.post(
        "/orders/",
        {"customer": customer, "total": "12.50"},
        content_type="application/json",
        headers=headers,
    )


def test_an_order_and_its_events_commit_together(db: None) -> None:
    response = order(Client(), "k-1")
    assert response.status_code == 201
    assert Order.objects.count() == 1
    assert count("outbox") == 2  # the Kafka and the RabbitMQ copy of order-placed


def test_a_retried_request_gets_the_first_response_and_places_nothing(db: None) -> None:
    client = Client()
    first = order(client, "k-2")
    again = order(client, "k-2")
    assert again.status_code == 201 and again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1 and count("outbox") == 2
    assert order(client, "k-2", customer="eve").status_code == 422  # another body
    assert order(client, None).status_code == 400  # no key
    assert Order.objects.count() == 1


def test_keys_are_each_users_own(db: None) -> None:
    client = Client()
    first = order(client, "k-3")
    # Another user with the same key and body: an order of its own, not ada's response.
    other = order(client, "k-3", user="eve")
    assert other.status_code == 201 and "Idempotent-Replayed" not in other
    assert other.content != first.content
    anonymous = order(client, "k-3", user=None)  # no token: refused, not a shared space
    assert anonymous.status_code == 403
    assert Order.objects.count() == 2


def test_an_order_rolled_back_leaves_no_event(db: None) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Order.objects.create(customer="bob", total=1)
        outbox().publish({"order": 0}, topic="order-placed")
        raise RuntimeError("payment declined")
    assert Order.objects.count() == 0
    assert count("outbox") == 0


class SmallBatches(RabbitShipments):
    batch_size = 5


def test_each_event_ships_once_through_duplicates_and_crashes(mqdedup_django_harness) -> None:
    harness = mqdedup_django_harness(SmallBatches)
    for order in range(20):
        harness.publish({"event": "order-placed", "order": order}, message_id=f"order-{order}")
    harness.deliver_each_twice()
    harness.run_crashing_after_commit(times=3)  # committed, then died before the ack
    harness.run()
    shipped = sorted(Shipment.objects.values_list("order_id", flat=True))
    assert shipped == list(range(20))
    assert count("processed_messages") == 20
    assert count("outbox") == 20  # one shipment-created event each
    assert harness.crashes == 3


class FailingShipments(RabbitShipments):
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.0)

    def handle(self, message: Message, ctx: Context) -> None:
        super().handle(message, ctx)  # a Shipment row and an outbox row...
        raise RuntimeError("label printer on fire")  # ...then the handler fails


def test_a_failing_handler_leaves_no_row_no_claim_no_event(mqdedup_django_harness) -> None:
    harness = mqdedup_django_harness(FailingShipments)
    harness.publish({"event": "order-placed", "order": 7}, message_id="order-7")
    harness.run()
    assert len(harness.dead_letters) == 1
    assert Shipment.objects.count() == 0
    assert count("processed_messages") == 0
    assert count("outbox") == 0
