"""External calls made once: ``ctx.step`` under ``mqdedup worker``, killed with SIGKILL.

A real payment HTTP server on loopback (deduplicating on the ``Idempotency-Key``
header, counting charges) is called from a RabbitMQ consumer's handler through
``ctx.step``. 500 messages, 30% of them copies of another (350 orders); the worker
process kills itself with ``SIGKILL`` three times, once at each moment: after the
charge before its record, after the record before the business writes, and after the
business writes (order row and outbox event) before the commit. The supervisor
restarts it each time. Afterwards: exactly one charge per order, one order row and one
outbox event per order, nothing dead-lettered; the order killed after the charge was
requested twice with the same key (the window the server's deduplication covers), the
one killed after its record only once (the rerun read the record).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from examples.flash_sale.gateway import PaymentServer
from mqdedup.cli import exitcodes
from mqdedup.db.schema import schema
from tests.acceptance.test_cli_process_killer import Supervised, healthz
from tests.integration.rabbitmq.support import make_consumer, order_counts
from tests.services import REPO, RabbitAdmin, prefixed_database, table_prefix, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ORDERS = 350
COPIES = 150
KILLS = {"m-40": "call", "m-120": "record", "m-200": "commit"}


def test_each_order_is_charged_once_through_three_kill_9s(
    pg_url: str, rabbitmq_url: str, tmp_path: Path
) -> None:
    prefix = table_prefix()
    orders = orders_table(prefix)
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    markers = tmp_path / "markers"
    markers.mkdir()
    ids = [f"m-{n}" for n in range(ORDERS)]
    rng = random.Random(32)
    deliveries = ids + rng.sample(ids, COPIES)  # 500 messages, 30% copies
    rng.shuffle(deliveries)
    for killed in KILLS:  # the killed orders come early, and once (their copies later)
        deliveries.remove(killed)
        deliveries.insert(list(KILLS).index(killed) * 60 + 10, killed)
    assert len(deliveries) == ORDERS + COPIES

    with (
        prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as db,
        PaymentServer() as gateway,
        contextlib.closing(RabbitAdmin(rabbitmq_url)) as admin,
    ):
        admin.declare(make_consumer(queue, prefix, rabbitmq_url)())
        admin.publish(queue, deliveries, body=lambda i: json.dumps({"order": i}).encode())
        env = {
            **os.environ,
            "STEPS_PREFIX": prefix,
            "STEPS_QUEUE": queue,
            "STEPS_GATEWAY": gateway.url,
            "STEPS_MARKERS": str(markers),
            "STEPS_KILLS": ",".join(f"{i}:{moment}" for i, moment in KILLS.items()),
            "MQDEDUP_DATABASE_URL": pg_url,
            "MQDEDUP_TABLE_PREFIX": prefix,
            "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
            "PYTHONPATH": str(REPO),
        }
        worker = Supervised("tests.acceptance.steps_consumers:PaymentsKiller", env)
        try:
            wait_for(
                lambda: (
                    worker.process.poll() is not None
                    or (
                        len(order_counts(db.engine, orders)) == ORDERS
                        and admin.depth(queue) == 0
                        and healthz(worker.port).get("restarts") == len(KILLS)
                    )
                ),
                120,
                "every order written, the queue drained, three restarts",
            )
            assert worker.process.poll() is None, worker.stop()[-3000:]
            restarts = healthz(worker.port).get("restarts")
        finally:
            errors = worker.stop()
            admin.delete(queue, f"{queue}.dlq")
        assert worker.process.returncode == exitcodes.OK, errors[-3000:]

        assert restarts == len(KILLS)
        assert sorted(path.name for path in markers.iterdir()) == sorted(
            f"{i}-{moment}" for i, moment in KILLS.items()
        )  # each kill happened
        ledger = gateway.ledger
        assert ledger.charges_per_order() == dict.fromkeys(ids, 1)  # one charge per order
        assert ledger.requests["m-40"] == 2  # killed after the call: called again, same key
        assert ledger.requests["m-120"] == 1  # killed after the record: the record was read
        assert order_counts(db.engine, orders) == dict.fromkeys(ids, 1)
        outbox = schema(prefix).outbox
        with db.engine.connect() as connection:
            events = connection.execute(select(outbox.c.payload)).scalars().all()
        assert sorted(json.loads(payload)["order"] for payload in events) == sorted(ids)
        assert admin.depth(f"{queue}.dlq") == 0
