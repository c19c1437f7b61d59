"""A RabbitMQ consumer whose ``ctx.step`` waits for a connection: run behind a PgBouncer
whose server pool (``default_pool_size = 1``) its message's transaction already holds.

``mqdedup worker tests.acceptance.pool_consumers:ChargeBehindSmallPool`` runs it; the
test's names travel as ``POOL_*`` environment variables. Before its step the handler
touches ``<POOL_MARKERS>/<message id>-waiting``; each call of the step appends a line
to ``<POOL_MARKERS>/calls``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.support import orders_table

_PREFIX = os.environ.get("POOL_PREFIX", "pool_")
_MARKERS = Path(os.environ.get("POOL_MARKERS", "."))


def charge(key: str) -> str:
    """The external call: counted in a file, one line per call."""
    with open(_MARKERS / "calls", "a") as calls:
        calls.write(key + "\n")
    return f"charge-{key[:8]}"


class ChargeBehindSmallPool(RabbitMQConsumer):
    """Writes the order (the transaction now holds a server connection), then charges
    through ``ctx.step``."""

    __test__ = False
    queue = os.environ.get("POOL_QUEUE", "pool-charges")
    table_prefix = _PREFIX
    batch_size = 1
    poll_timeout = 0.2
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.2)

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(insert(orders_table(_PREFIX)).values(message_id=message.id, body="x"))
        (_MARKERS / f"{message.id}-waiting").touch()
        return ctx.step("charge", charge)
