"""An order placed over HTTP, and the shipment a consumer creates for it."""

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    total = models.DecimalField(max_digits=12, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)


class Shipment(models.Model):
    """One per order: the consumer's ORM effect, created once per ``order-placed`` event."""

    order_id = models.BigIntegerField()
    message_id = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)
