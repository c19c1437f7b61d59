"""One message through the whole chain with OpenTelemetry on, in a process of its own.

``python -m tests.integration.outbox.tracing_chain '<json config>'``: a producer span
sends one Kafka record (``traceparent`` header), the chain's forwarder consumes it and
writes an outbox row for RabbitMQ, a relay publishes the row, the chain's receiver
consumes it. The spans (in-memory exporter) are printed as JSON on the last line. A
process of its own, because a tracer provider is global and set once per process.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import kafka
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import func, select

from mqdedup.cli.runners import create_publishers
from mqdedup.db import create_engine
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.stopping import StopToken
from tests.integration.outbox.chain_worker import build
from tests.integration.outbox.helpers import events_table


def _run_until(consumer: Any, engine: Any, done: Any, timeout: float = 90.0) -> None:
    stop = StopToken()
    thread = threading.Thread(target=consumer.run, args=(engine,), kwargs={"stop": stop})
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the consumer did not finish in time")
            time.sleep(0.05)
    finally:
        stop.request()
        thread.join(timeout=60)


def main() -> None:
    config: dict[str, Any] = json.loads(sys.argv[1])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    engine = create_engine(config["database_url"])
    events = events_table(config["prefix"])

    def count(consumer: str) -> int:
        with engine.connect() as connection:
            query = select(func.count()).select_from(events).where(events.c.consumer == consumer)
            return int(connection.execute(query).scalar_one())

    producer = kafka.KafkaProducer(bootstrap_servers=config["kafka"], acks="all")
    with trace.get_tracer("checkout").start_as_current_span(
        "place order", kind=trace.SpanKind.PRODUCER
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        headers = [("message-id", b"order-1")] + [(k, v.encode()) for k, v in carrier.items()]
        producer.send(config["topic"], value=b'{"order": 1}', headers=headers)
        producer.flush(timeout=30)
    producer.close()

    forwarder = build({**config, "role": "forwarder"})
    _run_until(forwarder, engine, lambda: count("A") == 1)
    relay = Relay(
        engine,
        create_publishers(rabbitmq_url=config["rabbitmq"]),
        prefix=config["prefix"],
        config=RelayConfig(poll_interval=0.2),
    )
    try:
        relay.drain(timeout=60)
    finally:
        relay.close()
    receiver = build({**config, "role": "receiver"})
    _run_until(receiver, engine, lambda: count("B") == 1)
    engine.dispose()
    provider.force_flush()
    spans = [
        {
            "name": span.name,
            "kind": span.kind.name,
            "trace_id": format(span.context.trace_id, "032x"),
            "span_id": format(span.context.span_id, "016x"),
            "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
            "attributes": dict(span.attributes or {}),
        }
        for span in exporter.get_finished_spans()
    ]
    print("SPANS " + json.dumps(spans), flush=True)


if __name__ == "__main__":
    main()
