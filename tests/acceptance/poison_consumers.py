"""A RabbitMQ consumer for the poison-id acceptance test, configured by environment.

``mqdedup worker tests.acceptance.poison_consumers:QueueOrders`` runs in fresh processes,
so the test's queue and table prefix travel as ``ACCEPT_*`` variables.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.support import orders_table

_PREFIX = os.environ.get("ACCEPT_PREFIX", "accept_")


class QueueOrders(RabbitMQConsumer):
    """Reads ``ACCEPT_QUEUE``; one business row per message in ``<ACCEPT_PREFIX>orders``."""

    __test__ = False
    queue = os.environ.get("ACCEPT_QUEUE", "accept-queue")
    table_prefix = _PREFIX
    batch_size = 50
    poll_timeout = 0.2

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(
            insert(orders_table(_PREFIX)).values(message_id=message.id, body=message.text()[:255])
        )
