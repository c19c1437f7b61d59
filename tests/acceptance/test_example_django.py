"""The Django example (``examples/django_orders``) end to end, as its README says.

``manage.py migrate`` creates mqdedup's tables (``mqdedup db check`` is then clean; a
database left at 0001 with schema 2's retention btree is brought to schema 3 by 0002);
the example's own pytest-django tests pass on PostgreSQL; orders placed over HTTP
write their ``order-placed`` events to the outbox in the view's transaction (each request
sent twice with its ``Idempotency-Key`` and the client's bearer token: one order each;
the keys are each user's own, anonymous keyed requests get 403);
``manage.py mqdedup_relay`` publishes them and ``manage.py mqdedup_worker`` (two
processes) creates one shipment per order with the ORM; SIGTERM stops both with exit 0.
"""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from mqdedup.db import create_engine
from tests.integration.django.support import (
    EXAMPLE,
    MQDEDUP,
    PYTHON,
    example_env,
    fresh_database,
    manage,
    migrated,
    run,
)
from tests.services import KafkaHelper, free_port, wait_for

pytestmark = [pytest.mark.integration]
ORDERS = 20
# Every request sent twice with its key, as a client retrying after a timeout does.
PLACE_ORDERS = f"""
from django.contrib.auth.models import User
from django.test import Client
from orders.auth import token_for
client = Client()
token = token_for(User.objects.create_user("shop-client"))
for n in range({ORDERS}):
    for attempt in range(2):
        response = client.post(
            "/orders/",
            {{"customer": f"c{{n}}", "total": "9.90"}},
            content_type="application/json",
            headers={{"Idempotency-Key": f"order-{{n}}", "Authorization": f"Bearer {{token}}"}},
        )
        assert response.status_code == 201, response.content
"""


@pytest.fixture
def database(pg_url: str) -> Iterator[tuple[str, Engine]]:
    with fresh_database(pg_url) as url:
        engine = create_engine(url)
        try:
            yield url, engine
        finally:
            engine.dispose()


def start(arguments: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(
            [PYTHON, "manage.py", *arguments],
            cwd=EXAMPLE,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def stop(process: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM: the supervisor drains its children and exits 0."""
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=40)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        raise AssertionError(f"{process.args!r} did not stop:\n{log.read_text()[-3000:]}") from None
    assert code == 0, f"{process.args!r} exited {code}:\n{log.read_text()[-3000:]}"


def shipped(engine: Engine) -> list[tuple[int, int]]:
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT order_id, count(*) FROM orders_shipment GROUP BY order_id")
        )
        return [(int(order), int(count)) for order, count in rows]


def test_django_example_runs_end_to_end(
    database: tuple[str, Engine], kafka_helper: KafkaHelper, rabbitmq_url: str, tmp_path: Path
) -> None:
    url, engine = database
    env = example_env(
        url,
        MQDEDUP_KAFKA_BOOTSTRAP=kafka_helper.bootstrap,
        MQDEDUP_RABBITMQ_URL=rabbitmq_url,
        # Created up front (and deleted afterwards): the relay need not wait for them.
        ORDERS_TOPIC=kafka_helper.create_topic(1, "dj-orders"),
        SHIPMENTS_TOPIC=kafka_helper.create_topic(1, "dj-shipments"),
    )
    prefix = env["ORDERS_TABLE_PREFIX"]

    # A database migrated by an older version (0001, schema 2: a btree for retention);
    # 0002 moves it to schema 3 (BRIN on PostgreSQL).
    older = manage("migrate", "mqdedup", "0001", "--no-input", env=env)
    assert older.returncode == 0, older.stdout + older.stderr
    with engine.begin() as connection:
        connection.execute(text(f"DROP INDEX {prefix}processed_at_brin"))
        connection.execute(
            text(
                f"CREATE INDEX {prefix}processed_at_idx "
                f"ON {prefix}processed_messages (processed_at)"
            )
        )
    migrated(url, env)
    with engine.connect() as connection:
        retention = connection.execute(
            text(
                "SELECT indexname FROM pg_indexes WHERE tablename = :t AND indexdef LIKE '%brin%'"
            ),
            {"t": f"{prefix}processed_messages"},
        ).scalars()
        assert list(retention) == [f"{prefix}processed_at_brin"]
    check = run(MQDEDUP, "db", "check", "--database", url, "--table-prefix", prefix, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "schema matches" in check.stdout

    tests = run(
        PYTHON,
        "-m",
        "pytest",
        "tests",
        "--ds=orders_project.settings",
        "-p",
        "no:cacheprovider",
        "-q",
        env=env,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "6 passed" in tests.stdout

    placed = manage("shell", "-c", PLACE_ORDERS, env=env)
    assert placed.returncode == 0, placed.stdout + placed.stderr

    port = free_port()
    worker_log, relay_log = tmp_path / "worker.log", tmp_path / "relay.log"
    worker = start(
        [
            "mqdedup_worker",
            "orders.consumers:RabbitShipments",
            "--processes",
            "2",
            "--health-port",
            str(port),
            "--shutdown-timeout",
            "20",
        ],
        env,
        worker_log,
    )
    relay = start(["mqdedup_relay", "--poll-interval", "0.2"], env, relay_log)
    try:
        wait_for(lambda: len(shipped(engine)) == ORDERS, 90, "a shipment for every order")
        # 200 once both worker processes run with a consumer attached (on a loaded
        # machine the second may still be attaching when the first has shipped all)
        wait_for(lambda: ready(port), 30, "both worker processes ready")
    finally:
        stop(worker, worker_log)
        stop(relay, relay_log)
    assert sorted(count for _, count in shipped(engine)) == [1] * ORDERS
    with engine.connect() as connection:
        orders = connection.execute(text("SELECT count(*) FROM orders_order")).scalar()
    assert orders == ORDERS  # the repeated requests placed nothing


def ready(port: int) -> bool:
    """True when the worker's ``/healthz/ready`` answers 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=5):
            return True
    except OSError:  # HTTPError (503: not ready yet) is an OSError too
        return False
