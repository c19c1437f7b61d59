"""OpenTelemetry: producer -> consumer -> outbox -> relay -> downstream consumer is one
trace, on real Kafka, RabbitMQ and PostgreSQL (the SDK's in-memory exporter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from tests.integration.outbox.helpers import OutboxDb
from tests.services import REPO, KafkaHelper, RabbitAdmin, require_module

pytestmark = pytest.mark.integration
require_module("opentelemetry.sdk.trace")


def test_one_trace_from_the_producer_through_the_outbox_to_the_next_consumer(
    db: OutboxDb,
    kafka_helper: KafkaHelper,
    rabbit: RabbitAdmin,
    kafka_bootstrap: str,
    rabbitmq_url: str,
) -> None:
    config = {
        "database_url": db.url,
        "prefix": db.prefix,
        "topic": kafka_helper.create_topic(partitions=1, kind="traced"),
        "group": f"traced-{uuid.uuid4().hex[:8]}",
        "queue": rabbit.queue("traced"),
        "kafka": kafka_bootstrap,
        "rabbitmq": rabbitmq_url,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.outbox.tracing_chain", json.dumps(config)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("SPANS "))
    spans: list[dict[str, Any]] = json.loads(line.removeprefix("SPANS "))
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)

    (producer,) = by_name["place order"]
    consume_a, consume_b = (
        by_name[f"process {config['topic']}"][0],
        by_name[f"process {config['queue']}"][0],
    )
    transactions = {span["parent_id"]: span for span in by_name["mqdedup transaction"]}
    (publish,) = by_name[f"publish {config['queue']}"]
    # One trace, each step the child of the one before.
    assert {span["trace_id"] for span in spans} == {producer["trace_id"]}
    assert consume_a["kind"] == "CONSUMER" and consume_a["parent_id"] == producer["span_id"]
    transaction_a = transactions[consume_a["span_id"]]
    assert publish["kind"] == "PRODUCER" and publish["parent_id"] == transaction_a["span_id"]
    assert consume_b["parent_id"] == publish["span_id"]
    assert consume_a["attributes"]["messaging.message.id"] == "order-1"
    assert transactions[consume_b["span_id"]]["name"] == "mqdedup transaction"
