"""The FastAPI example (``examples/fastapi_orders``) end to end, as its README runs it.

``setup``, ``mqdedup relay`` and the demo clients as subprocesses on the shared
PostgreSQL and Kafka, with unique table prefixes, topic and group. About 1,000 HTTP
requests (30% of the clients retry with the same key, 10% send twice at once) → each
order placed once, its event published once, shipped once by the consumer in the app.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import MetaData

from mqdedup.db import create_engine
from mqdedup.db.schema import schema
from tests.acceptance.test_examples import kafka_records, run, scalar
from tests.services import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]
#: Clients; with the retries and the doubled requests (the seeded demo) 1,000 HTTP requests
#: before the repeats of 409 answers.
CLIENTS = 700


@pytest.fixture
def example_env(pg_url: str, kafka_bootstrap: str) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "MQDEDUP_TABLE_PREFIX": f"exf_{tag}_",
        "EXAMPLE_TABLE_PREFIX": f"exf_{tag}_",
        "API_ORDER_EVENTS_TOPIC": f"exf-order-events-{tag}",
        "API_SHIPPING_GROUP": f"exf-shipping-{tag}",
    }
    yield env
    engine = create_engine(pg_url)
    prefix = env["EXAMPLE_TABLE_PREFIX"]
    metadata = MetaData()
    metadata.reflect(engine, only=lambda name, _: name.startswith(prefix))
    metadata.drop_all(engine)
    schema(env["MQDEDUP_TABLE_PREFIX"]).metadata.drop_all(engine)
    engine.dispose()
    import kafka

    admin = kafka.KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        topic = env["API_ORDER_EVENTS_TOPIC"]
        admin.delete_topics([t for t in (topic, f"{topic}.DLT") if t in set(admin.list_topics())])
    finally:
        admin.close()


def test_fastapi_orders_example_places_publishes_and_ships_each_order_once(
    example_env: dict[str, str],
) -> None:
    env = example_env
    prefix = env["EXAMPLE_TABLE_PREFIX"]
    run("-m", "examples.fastapi_orders.setup", env=env)
    # The README's command: the demo clients, with mqdedup relay beside them.
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.fastapi_orders.demo",
            "--orders",
            str(CLIENTS),
            "--relay",
        ],
        env={
            **env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
            "MQDEDUP_RELAY_KEEP_PUBLISHED": "1",  # rows kept: counted by state below
        },
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report = demo.stdout
    assert demo.returncode == 0, f"{report}\n{demo.stderr[-3000:]}"
    assert "each order placed once and shipped once" in report, report
    sent = int(re.search(r"requests sent\s+(\d+)", report).group(1))  # type: ignore[union-attr]
    assert sent >= 1000, report
    assert int(re.search(r"answers replayed\s+(\d+)", report).group(1)) > 0  # type: ignore[union-attr]

    engine = create_engine(env["MQDEDUP_DATABASE_URL"])
    try:
        tables = schema(env["MQDEDUP_TABLE_PREFIX"])
        # Each order once; each client's key claimed once, with its stored response.
        assert scalar(engine, f"SELECT count(*) FROM {prefix}api_orders") == CLIENTS
        assert (
            scalar(
                engine,
                f"SELECT count(*) FROM {tables.processed.name} "
                "WHERE consumer_name LIKE 'http:%' AND result IS NOT NULL",
            )
            == CLIENTS
        )
        # Each event written once and published once (one record per message id).
        assert (
            scalar(engine, f"SELECT count(*) FROM {tables.outbox.name} WHERE state = 'published'")
            == CLIENTS
        )
        records = kafka_records(env["MQDEDUP_KAFKA_BOOTSTRAP"], env["API_ORDER_EVENTS_TOPIC"])
        ids = Counter(dict(record.headers).get("message-id", b"").decode() for record in records)
        assert len(ids) == CLIENTS and set(ids.values()) == {1}
        # Consumed downstream once: one shipment per order, one claim per event.
        assert scalar(engine, f"SELECT count(*) FROM {prefix}shipments") == CLIENTS
        assert scalar(engine, f"SELECT count(DISTINCT order_id) FROM {prefix}shipments") == CLIENTS
        shipping = env["API_SHIPPING_GROUP"]
        assert (
            scalar(
                engine,
                f"SELECT count(*) FROM {tables.processed.name} WHERE consumer_name = '{shipping}'",
            )
            == CLIENTS
        )
    finally:
        engine.dispose()


def test_fastapi_orders_example_scopes_keys_to_the_authenticated_customer(
    example_env: dict[str, str], tmp_path: Path
) -> None:
    """The example served by uvicorn: a customer sending another's key (and body) gets an
    order of their own, never the other's stored response; forged tokens are refused."""
    import httpx

    from examples.fastapi_orders.config import customer_token
    from tests.integration.http.servers import free_port, serving

    env = example_env
    run("-m", "examples.fastapi_orders.setup", env=env)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "examples.fastapi_orders.app:create_app",
        "--lifespan",
        "off",  # the HTTP side only: no shipping consumer
        "--port",
        str(port),
    ]
    body = {"item": "book", "quantity": 1}
    with (
        serving(command, env, tmp_path / "uvicorn.log", "/docs", port) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):

        def place(token: str) -> httpx.Response:
            headers = {"Idempotency-Key": "same-key", "Authorization": f"Bearer {token}"}
            return http.post("/orders", json=body, headers=headers)

        ann = place(customer_token("ann"))
        assert ann.status_code == 201 and ann.json()["customer"] == "ann"
        assert place(customer_token("ann")).json() == ann.json()  # her own replay
        bob = place(customer_token("bob"))
        assert bob.status_code == 201 and "idempotent-replayed" not in bob.headers
        assert bob.json()["customer"] == "bob" and bob.json()["id"] != ann.json()["id"]
        forged = place("ann." + "0" * 64)
        assert forged.status_code == 401
        anonymous = http.post("/orders", json=body, headers={"Idempotency-Key": "same-key"})
        assert anonymous.status_code in (401, 403)
