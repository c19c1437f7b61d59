"""A RabbitMQ consumer for the ``mqdedup worker`` CLI test, configured by environment.

``MQDEDUP_TEST_RABBIT_QUEUE`` and ``MQDEDUP_TEST_RABBIT_PREFIX`` are read at import, in
each worker process the supervisor starts; the URL comes from ``MQDEDUP_RABBITMQ_URL``.
"""

from __future__ import annotations

import os

from tests.integration.rabbitmq.support import OrdersConsumer
from tests.support import orders_table

_PREFIX = os.environ.get("MQDEDUP_TEST_RABBIT_PREFIX", "mqdedup_")


class CliOrders(OrdersConsumer):
    queue = os.environ.get("MQDEDUP_TEST_RABBIT_QUEUE", "")
    table_prefix = _PREFIX
    orders = orders_table(_PREFIX)
    batch_size = 50
