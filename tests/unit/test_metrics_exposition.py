"""``/metrics`` is valid Prometheus text: parsed by prometheus_client's own parser."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mqdedup import InMemoryBroker, Metrics
from mqdedup.cli.health import HealthServer, process_stats, render_snapshots
from mqdedup.consumers.worker import Worker
from tests.support import OrderConsumer


def _families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_a_worker_snapshot_renders_counters_lag_histograms_and_process(sqlite_engine) -> None:  # type: ignore[no-untyped-def]
    broker = InMemoryBroker(seed=2)
    for number in range(300):
        broker.publish("orders", json.dumps({"order": number}), message_id=f"m{number}")
    broker.inject_duplicates("orders", 0.2)
    metrics = Metrics()
    Worker(OrderConsumer(), broker.transport("orders"), sqlite_engine, metrics=metrics).run(
        until_idle=True
    )
    metrics.lag = {"orders/0": 0}
    snapshot = {**metrics.snapshot(), "process": process_stats()}

    text = render_snapshots({("orders", "0"): snapshot}, {"backlog": 3.0})
    families = _families(text)

    processed = families["mqdedup_messages_processed"]
    assert processed.type == "counter"  # type: ignore[attr-defined]
    (sample,) = processed.samples  # type: ignore[attr-defined]
    assert sample.name == "mqdedup_messages_processed_total"
    assert sample.labels == {"consumer": "orders", "process": "0"} and sample.value == 300
    assert families["mqdedup_outbox_backlog"].samples[0].value == 3.0  # type: ignore[attr-defined]
    assert families["mqdedup_consumer_lag"].samples[0].labels["partition"] == "orders/0"  # type: ignore[attr-defined]
    transaction = families["mqdedup_transaction_seconds"]
    assert transaction.type == "histogram"  # type: ignore[attr-defined]
    samples = {s.name: s for s in transaction.samples if "le" not in s.labels}  # type: ignore[attr-defined]
    assert samples["mqdedup_transaction_seconds_count"].value == metrics.batches
    infinite = [s for s in transaction.samples if s.labels.get("le") == "+Inf"]  # type: ignore[attr-defined]
    assert infinite[0].value == metrics.batches
    assert families["mqdedup_handler_seconds"].type == "histogram"  # type: ignore[attr-defined]
    assert families["mqdedup_process_resident_memory_bytes"].samples[0].value > 0  # type: ignore[attr-defined]


def test_the_health_server_serves_parseable_metrics_with_build_info() -> None:
    snapshots = {("orders", "0"): {**Metrics(processed=5).snapshot(), "process": process_stats()}}
    server = HealthServer(0, lambda: (True, True, {}), lambda: snapshots, host="127.0.0.1").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
            content_type = reply.headers["Content-Type"]
            text = reply.read().decode()
    finally:
        server.stop()
    assert content_type.startswith("text/plain")
    families = _families(text)
    build = families["mqdedup_build_info"]
    assert build.samples[0].labels["version"]  # type: ignore[attr-defined]
    assert "process_cpu_seconds" in families  # the supervisor's own process
    assert families["mqdedup_messages_processed"].samples[0].value == 5  # type: ignore[attr-defined]
