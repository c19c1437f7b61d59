"""Django scenarios on real services: run by ``test_django_faults.py`` in a pytest of
their own (``-p no:django``), with the example project's settings and a migrated
database in the environment. Not collected by the main suite (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import django
import pytest

django.setup()  # DJANGO_SETTINGS_MODULE=orders_project.settings (the example project)

from django.conf import settings  # noqa: E402
from django.db import IntegrityError, connection, transaction  # noqa: E402
from orders.consumers import KafkaShipments, RabbitShipments, create_shipment  # noqa: E402
from orders.models import Order, Shipment  # noqa: E402

from mqdedup import Consumer, Context, Message, RetryPolicy  # noqa: E402
from mqdedup.consumers.memory import InMemoryBroker  # noqa: E402
from mqdedup.consumers.worker import Worker  # noqa: E402
from mqdedup.django import sessions  # noqa: E402
from mqdedup.testing.brokers import (  # noqa: E402
    KafkaHarness,
    RabbitMQHarness,
    WorkerProcess,
    wait_for,
)
from tests.integration.django.support import proxied  # noqa: E402

DATABASE_URL = os.environ["ORDERS_DATABASE_URL"]
PREFIX = settings.MQDEDUP["TABLE_PREFIX"]
SESSIONS = "mqdedup.django.testing:worker_sessions"


def shipments(run: str) -> Counter[str]:
    """Shipment rows per message id of one scenario."""
    ids = Shipment.objects.filter(message_id__startswith=run).values_list("message_id", flat=True)
    return Counter(ids)


def publish_with_duplicates(harness: Any, run: str, count: int, rate: float = 0.3) -> None:
    """``count`` events, then ``rate`` of them once more (a retrying producer)."""
    events = [({"event": "order-placed", "order": n}, f"{run}-{n}") for n in range(count)]
    for body, message_id in events:
        harness.publish(body, message_id=message_id, key=str(body["order"]).encode())
    for body, message_id in events[:: round(1 / rate)]:
        harness.publish(body, message_id=message_id, key=str(body["order"]).encode())


def assert_once(run: str, count: int) -> None:
    found = shipments(run)
    assert len(found) == count, f"{count - len(found)} events have no shipment"
    twice = {message_id: n for message_id, n in found.items() if n != 1}
    assert not twice, f"shipped more than once: {twice}"


def test_kafka_duplicates_and_kill_after_commit_three_times(tmp_path: Path) -> None:
    run = f"k{uuid.uuid4().hex[:8]}"
    harness = KafkaHarness(
        KafkaShipments,
        DATABASE_URL,
        tmp_path,
        bootstrap=os.environ["MQDEDUP_KAFKA_BOOTSTRAP"],
        attributes={"batch_size": 10},
        sessions=SESSIONS,
    )
    try:
        publish_with_duplicates(harness, run, 60)
        assert harness.run_killing_after_commit(times=3) == 3
        harness.run_until_drained()
        assert_once(run, 60)
    finally:
        harness.close()


def test_rabbitmq_duplicates(tmp_path: Path) -> None:
    run = f"r{uuid.uuid4().hex[:8]}"
    harness = RabbitMQHarness(
        RabbitShipments,
        DATABASE_URL,
        tmp_path,
        url=os.environ["MQDEDUP_RABBITMQ_URL"],
        attributes={"batch_size": 10},
        sessions=SESSIONS,
    )
    try:
        publish_with_duplicates(harness, run, 40)
        harness.run_until_drained()
        assert_once(run, 40)
        assert harness.waiting(f"{harness.queue}.dlq") == 0
    finally:
        harness.close()


def _backends(application_name: str) -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [application_name]
        )
        return {row[0] for row in cursor.fetchall()}


def test_persistent_connection_survives_a_database_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart as the worker sees it: its connection dies inside a batch's open
    transaction, and connecting again is refused for ~5 s (a proxy in between is cut)."""
    run = f"c{uuid.uuid4().hex[:8]}"
    application = f"dj-worker-{run}"
    monkeypatch.setenv("ORDERS_CONN_MAX_AGE", "none")  # the worker keeps its connection
    monkeypatch.setenv("ORDERS_APP_NAME", application)
    harness = RabbitMQHarness(
        RabbitShipments,
        DATABASE_URL,
        tmp_path,
        url=os.environ["MQDEDUP_RABBITMQ_URL"],
        attributes={"batch_size": 10},
        sessions=SESSIONS,
    )
    try:
        with proxied(DATABASE_URL) as (through_proxy, proxy):
            monkeypatch.setenv("ORDERS_DATABASE_URL", through_proxy)  # the worker's settings
            for n in range(200):
                harness.publish({"event": "order-placed", "order": n}, message_id=f"{run}-{n}")
            # After 35 handler calls the worker waits inside a batch's open transaction
            # (its claims written, batches before it committed) until told to go on.
            worker = harness.start_worker(hold_mid_batch=35)
            wait_for(lambda: worker.file("held").exists() or not worker.alive, 60, "the hold")
            worker.ensure_alive()
            before = _backends(application)
            assert len(before) == 1, before  # one persistent connection
            proxy.cut()  # the restart: the connection dies, and new ones are refused
            committed = worker.committed
            assert committed < 200, committed
            worker.file("release").touch()  # the handler's next ORM write meets the outage
            _wait_out_the_outage(worker, seconds=5)
            assert worker.committed == committed  # nothing committed while it was down
            assert not _backends(application)
            proxy.open()
            try:
                wait_for(lambda: worker.committed >= 200, 60, "the rest of the messages")
            except AssertionError as error:
                raise AssertionError(f"{error}\n{_log(worker)}") from None
            worker.ensure_alive()
            after = _backends(application)
            assert len(after) == 1 and not (after & before), (before, after)  # kept one again
            assert worker.terminate() == 0
        assert_once(run, 200)
        assert harness.waiting(f"{harness.queue}.dlq") == 0
        assert "dead-letter" not in worker.log_tail(10_000).lower()
    finally:
        harness.close()


def _wait_out_the_outage(worker: WorkerProcess, seconds: float) -> None:
    """Keep the database away ``seconds``; the worker must stay up, saying it waits."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        worker.ensure_alive()
        time.sleep(0.2)  # the outage's length is the point here, not a synchronisation
    waits = worker.log_tail(10_000).count("database unavailable; retrying")
    assert waits >= 2, _log(worker)  # it tried again, and was refused


def _log(worker: WorkerProcess, lines: int = 40) -> str:
    """The worker log's last lines, without the hold's (every handler call after the
    release passes the hold again, and says so)."""
    kept = [line for line in worker.log_tail(10_000).splitlines() if "holding" not in line]
    return "\n".join(kept[-lines:])


class Fates(Consumer):
    """A memory-broker consumer whose messages say how their handler ends."""

    table_prefix = PREFIX
    batch_size = 10
    poll_timeout = 0.1
    retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.0)

    def handle(self, message: Message, ctx: Context) -> Any:
        result = create_shipment(message, ctx)  # a Shipment row and an outbox row
        fate = message.json()["fate"]
        if fate == "raise":
            raise RuntimeError("label printer on fire")
        if fate == "caught":  # the same error in a savepoint of its own: the handler goes on
            with contextlib.suppress(IntegrityError), transaction.atomic():
                Order.objects.create(pk=message.json()["existing"], customer="x", total=1)
        if fate == "swallow":
            # An ORM error caught without a savepoint: Django marks the rollback.
            with contextlib.suppress(IntegrityError):
                Order.objects.create(pk=message.json()["existing"], customer="x", total=1)
        return result


def _claimed(consumer: str) -> set[str]:
    """Message ids with a claim of ``consumer``."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT message_id FROM {PREFIX}processed_messages WHERE consumer_name = %s",
            [consumer],
        )
        return {row[0] for row in cursor.fetchall()}


def _outbox_causes(run: str) -> Counter[str]:
    """Outbox rows per incoming message id (their ``causation-id`` header) of one run."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT headers FROM {PREFIX}outbox")
        rows = [row[0] if isinstance(row[0], dict) else json.loads(row[0]) for row in cursor]
        causes = (headers.get("causation-id", "") for headers in rows)
        return Counter(cause for cause in causes if cause.startswith(run))


@pytest.mark.parametrize("isolation", ["auto", "savepoint"])
def test_failed_handlers_leave_no_row_no_claim_no_outbox_row(isolation: str) -> None:
    run = f"f{uuid.uuid4().hex[:8]}"
    existing = Order.objects.create(customer="existing", total=1).pk
    fates = ["ok", "raise", "caught", "swallow", "ok"]
    broker = InMemoryBroker()
    for n, fate in enumerate(fates):
        body = {"event": "order-placed", "order": n, "fate": fate, "existing": existing}
        broker.publish("fates", json_bytes(body), message_id=f"{run}-{n}")
    consumer_class = type("Fates", (Fates,), {"name": run, "failure_isolation": isolation})
    started = time.monotonic()
    Worker(consumer_class(), broker.transport("fates"), sessions()).run(until_idle=True)
    assert time.monotonic() - started < 30
    good = [f"{run}-{n}" for n, fate in enumerate(fates) if fate in ("ok", "caught")]
    assert sorted(shipments(run)) == good
    assert _claimed(run) == set(good)  # no claim of a failed message
    assert _outbox_causes(run) == dict.fromkeys(good, 1)  # no outbox row of one
    reasons = [letter.record.reason for letter in broker.dead_letters["fates"]]
    assert len(reasons) == 2
    raised = [reason for reason in reasons if "label printer on fire" in reason]
    swallowed = [reason for reason in reasons if reason not in raised]
    assert len(raised) == 1, reasons
    # PostgreSQL: the aborted transaction is found first (the cause and the fix named);
    # MariaDB fails only the statement, and Django's mark for rollback is the reason.
    assert "without a savepoint" in swallowed[0] or "marked it for rollback" in swallowed[0]


def json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def test_idempotency_key_in_flight_gets_409_then_the_stored_response() -> None:
    from django.db import connections
    from django.http import JsonResponse
    from django.test import RequestFactory

    from mqdedup.django import idempotent

    inside, release = threading.Event(), threading.Event()

    @idempotent(caller=lambda request: "scenario-client")  # no auth here: a named caller
    def place(request: Any) -> Any:
        order = Order.objects.create(customer="slow", total=1)
        inside.set()
        assert release.wait(30)  # the first request holds its key, uncommitted
        return JsonResponse({"order": order.pk}, status=201)

    key = f"key-{uuid.uuid4().hex}"
    factory = RequestFactory()

    def request() -> Any:
        return factory.post(
            "/orders/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
        )

    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(place(request()))
        finally:
            connections.close_all()  # this thread's own connection

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(30)
        started = time.monotonic()
        busy = place(request())
        assert busy.status_code == 409 and time.monotonic() - started < 5  # never waits
    finally:
        release.set()
        thread.join(30)
    assert answers[0].status_code == 201
    replay = place(request())
    assert replay.status_code == 201 and replay.content == answers[0].content
    assert replay["Idempotent-Replayed"] == "true"
    assert Order.objects.filter(pk=json.loads(answers[0].content)["order"]).exists()
