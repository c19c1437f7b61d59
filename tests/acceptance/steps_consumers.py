"""A RabbitMQ consumer that charges a payment HTTP server through ``ctx.step`` and kills
its own process (``SIGKILL``) once at chosen moments.

``mqdedup worker tests.acceptance.steps_consumers:PaymentsKiller`` runs it; the test's
names travel as ``STEPS_*`` environment variables. ``STEPS_KILLS`` lists
``<message id>:<moment>`` pairs; each kills the process once (a marker file in
``STEPS_MARKERS`` remembers it), at one of the moments:

* ``call``: the payment server charged, the step's record not written yet;
* ``record``: the step recorded, the message's transaction not committed (nothing of
  the business written yet);
* ``commit``: the order row and the outbox event written, not committed.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from typing import Any

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.rabbitmq import RabbitMQConsumer
from tests.support import orders_table

_PREFIX = os.environ.get("STEPS_PREFIX", "steps_")
_GATEWAY = os.environ.get("STEPS_GATEWAY", "http://127.0.0.1:1")
_MARKERS = os.environ.get("STEPS_MARKERS", "")
_KILLS = dict(pair.split(":", 1) for pair in os.environ.get("STEPS_KILLS", "").split(",") if pair)


def _die_at(moment: str, message: Message) -> None:
    """SIGKILL this process the first time ``message`` reaches ``moment`` (if chosen)."""
    if _KILLS.get(str(message.id)) != moment:
        return
    try:  # O_EXCL: only the first run of the message creates it (and dies)
        os.close(os.open(os.path.join(_MARKERS, f"{message.id}-{moment}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def charge(key: str, message: Message) -> dict[str, Any]:
    """POST the charge with its idempotency key; the server answers with the charge."""
    request = urllib.request.Request(
        f"{_GATEWAY}/charge",
        data=json.dumps({"order": message.id, "amount": 10}).encode(),
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        charged: dict[str, Any] = json.load(reply)
    _die_at("call", message)  # charged, not recorded
    return charged


class PaymentsKiller(RabbitMQConsumer):
    """Charge through ``ctx.step``, then write the order and its event in the transaction."""

    __test__ = False
    queue = os.environ.get("STEPS_QUEUE", "steps-payments")
    table_prefix = _PREFIX
    batch_size = 50
    poll_timeout = 0.2
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.2)

    def handle(self, message: Message, ctx: Context) -> Any:
        charged = ctx.step("charge", lambda key: charge(key, message))
        _die_at("record", message)  # recorded, nothing of the business written
        ctx.session.execute(
            insert(orders_table(_PREFIX)).values(message_id=message.id, body=charged["charge_id"])
        )
        ctx.outbox.publish(
            {"order": message.id, "charge": charged["charge_id"]},
            exchange="order-events",
            routing_key="order.paid",
        )
        _die_at("commit", message)  # written, not committed
        return {"charge_id": charged["charge_id"]}
