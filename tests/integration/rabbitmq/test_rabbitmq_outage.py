"""RabbitMQ stopped mid-run (a PRIVATE node, never the shared one): pause, resume.

The outage lasts four times the worker's ``reconnect_backoff_max``: several reconnect
attempts fail while it waits, and none of them may give up or dead-letter anything.
"""

from __future__ import annotations

import threading

import pytest

from mqdedup import Message
from tests.integration.rabbitmq.conftest import Database
from tests.integration.rabbitmq.support import (
    ThreadedWorker,
    make_consumer,
    order_counts,
    poll,
    with_duplicates,
)
from tests.services import PrivateRabbitMQ, RabbitAdmin, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RECONNECT_BACKOFF_MAX = 2.0
OUTAGE_SECONDS = 4 * RECONNECT_BACKOFF_MAX


def test_rabbitmq_stopped_mid_run_the_worker_waits_reconnects_and_resumes(
    db: Database, private_rabbit: PrivateRabbitMQ
) -> None:
    url = private_rabbit.url
    admin = RabbitAdmin(url)
    ids = with_duplicates(3_000, 0.2, seed=5)
    unique = sorted(set(ids))
    in_handler, release = threading.Event(), threading.Event()
    hold_id = unique[1_000]

    def hold_until_the_broker_is_down(message: Message) -> None:
        if message.id == hold_id and not in_handler.is_set():
            in_handler.set()
            if not release.wait(120):
                raise TimeoutError("never released")

    consumer = make_consumer(
        "outage-orders",
        db.prefix,
        url,
        batch_size=100,
        reconnect_backoff_max=RECONNECT_BACKOFF_MAX,
        before_write=hold_until_the_broker_is_down,
    )()
    admin.declare(consumer)
    admin.publish("outage-orders", ids)
    admin.close()

    with ThreadedWorker(consumer, db.engine) as worker:
        assert in_handler.wait(60), "the worker never reached the held batch"
        private_rabbit.service.stop()  # mid-batch: the batch's deliveries die with it
        release.set()  # the batch commits; its acks cannot be sent
        wait_for(lambda: not worker.transport.connected, 30, "the worker to see the outage")

        def still_waiting() -> None:
            assert worker.thread.is_alive() and worker.error is None, "the worker gave up"
            assert worker.metrics.dead_lettered == 0, "an outage must not dead-letter"
            assert not worker.transport.connected, (
                f"connected to a stopped broker? generation {worker.transport.generation}"
            )

        poll(OUTAGE_SECONDS, still_waiting)
        rows_during_outage = len(order_counts(db.engine, db.orders))
        assert hold_id in order_counts(db.engine, db.orders)

        private_rabbit.service.start()
        admin = RabbitAdmin(url)
        wait_for(
            lambda: (
                len(order_counts(db.engine, db.orders)) == len(unique)
                and admin.depth("outage-orders") == 0
            ),
            120,
            "the worker to resume and finish",
        )
        metrics = worker.finish()

    counts = order_counts(db.engine, db.orders)
    assert sorted(counts) == unique, "nothing lost across the restart"
    assert set(counts.values()) == {1}, "nothing applied twice"
    assert rows_during_outage < len(unique), "the outage really was mid-run"
    assert worker.transport.reconnects >= 1
    assert metrics.dead_lettered == 0
    assert hold_id in consumer.duplicate_ids, "the unacked batch came back and was skipped"
    assert admin.depth("outage-orders") == 0 and admin.depth("outage-orders.dlq") == 0
    admin.close()
