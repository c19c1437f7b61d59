"""What each third-party internal kept in the adapters buys, with and without it (issue 41).

docs/architecture.md, "Third-party internals in the adapters", quotes these figures:

* ``consumer``: a ``RabbitMQTransport`` fetching and settling small persistent messages
  in batches of 250 (prefetch 500): process CPU per message with its own frame decoding
  (pika's ``_impl``, ``_frame_buffer``, ``_process_frame``, ``_on_data_available``,
  ``_consumers``) and without (``install_fast_path`` returning None: pika's own path);
* ``relay``: ``RabbitMQPublisher.publish_batch`` of ~100-byte rows in batches of 2,000
  (confirms, persistent, mandatory): rows/s and CPU per row with its own ``basic.publish``
  frames (``_adapter_emit_data``, ``_body_max_length``) and without
  (``PublishFrames.open`` returning None: ``channel.basic_publish``);
* ``kafka``: ``KafkaPublisher.publish_batch`` of 2,000 records, one of 1 MB, to a topic
  with ``max.message.bytes=512000``: seconds per batch with kafka-python's
  ``_produce_future`` and without (``_was_aborted`` returning None: every suspect alone).

Runs are interleaved (with, without, with, ...); medians are printed. Usage::

    eval "$(bash scripts/services.sh env)"
    .venv/bin/python -m bench.adapter_internals_bench --runs 3

URLs come from MQDEDUP_RABBITMQ_URL and MQDEDUP_KAFKA_BOOTSTRAP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pika

from mqdedup.outbox.publishers import OutboxRecord

Measure = Callable[[bool], tuple[float, float]]


@contextmanager
def patched(owner: Any, name: str, value: Any, active: bool) -> Iterator[None]:
    """``owner.name = value`` inside the block when ``active`` (the internal missing)."""
    saved = owner.__dict__[name]
    if active:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def rows(destination: str, routing_key: str | None, count: int, big: int | None) -> list[Any]:
    now = datetime.now(UTC)
    return [
        OutboxRecord(
            n,
            f"m{n}",
            "kafka" if routing_key is None else "rabbitmq",
            destination,
            routing_key,
            None if routing_key is not None else f"k{n % 7}".encode(),
            {"message-id": f"m{n}"},
            None,
            b"x" * (1_000_000 if n == big else 100),
            0,
            now,
        )
        for n in range(count)
    ]


def consumer(url: str, messages: int) -> Measure:
    import mqdedup.rabbitmq.io_thread as io_thread
    from mqdedup.rabbitmq import Topology
    from mqdedup.rabbitmq.transport import RabbitMQTransport

    def run(without: bool) -> tuple[float, float]:
        queue = f"internals-{uuid.uuid4().hex[:8]}"
        connection = pika.BlockingConnection(pika.URLParameters(url))
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        persistent = pika.BasicProperties(delivery_mode=2, message_id="m")
        for n in range(messages):
            channel.basic_publish("", queue, b'{"n": %d}' % n, persistent)
        with patched(io_thread, "install_fast_path", lambda *_: None, without):
            transport = RabbitMQTransport(
                Topology(queue), url, connection_name=queue, prefetch=500
            ).start()
            cpu, wall, done = time.process_time(), time.monotonic(), 0
            while done < messages:
                batch = transport.fetch(250, 5.0)
                transport.settle(batch)
                done += len(batch)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            transport.close()
        channel.queue_delete(queue)
        channel.queue_delete(f"{queue}.dlq")
        connection.close()
        return cpu / messages * 1e6, messages / wall

    return run


def relay(url: str, messages: int) -> Measure:
    from mqdedup.rabbitmq import RabbitMQPublisher
    from mqdedup.rabbitmq.publish_frames import PublishFrames

    def run(without: bool) -> tuple[float, float]:
        queue = f"internals-{uuid.uuid4().hex[:8]}"
        connection = pika.BlockingConnection(pika.URLParameters(url))
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        records = rows("", queue, messages, None)
        none = classmethod(lambda cls, *_: None)
        with patched(PublishFrames, "open", none, without):
            publisher = RabbitMQPublisher(url)
            cpu, wall = time.process_time(), time.monotonic()
            for start in range(0, messages, 2000):
                results = publisher.publish_batch(records[start : start + 2000])
                assert all(r.ok for r in results)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            publisher.close()
        channel.queue_delete(queue)
        connection.close()
        return cpu / messages * 1e6, messages / wall

    return run


def kafka(bootstrap: str) -> Measure:
    import kafka as kafka_python

    import mqdedup.kafka.producer as producer
    from mqdedup.kafka import KafkaPublisher

    admin = kafka_python.KafkaAdminClient(bootstrap_servers=bootstrap)

    def run(without: bool) -> tuple[float, float]:
        topic = f"internals-{uuid.uuid4().hex[:8]}"
        spec = {"num_partitions": 3, "configs": {"max.message.bytes": "512000"}}
        admin.create_topics({topic: spec}, wait_for_metadata=True)
        records = rows(topic, None, 2000, 1000)
        with patched(producer, "_was_aborted", lambda _future: None, without):
            publisher = KafkaPublisher(bootstrap, producer_config={"max_request_size": 4_000_000})
            publisher.publish_batch(records[:1])  # metadata and connections
            cpu, wall = time.process_time(), time.monotonic()
            results = publisher.publish_batch(records)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            publisher.close()
        assert sum(not r.ok for r in results) == 1
        admin.delete_topics([topic])
        return cpu, wall

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--only", choices=["consumer", "relay", "kafka"], action="append")
    args = parser.parse_args(argv)
    url = os.environ.get("MQDEDUP_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    benches: dict[str, tuple[Callable[[], Measure], str]] = {
        "consumer": (lambda: consumer(url, args.messages), "µs CPU/message, messages/s"),
        "relay": (lambda: relay(url, args.messages), "µs CPU/row, rows/s"),
        "kafka": (lambda: kafka(bootstrap), "s CPU, s per 2,000-record batch"),
    }
    for name in args.only or list(benches):
        make, unit = benches[name]
        measure = make()
        got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.runs):
            for without in (False, True):
                got[without].append(measure(without))
        for without in (False, True):
            first = statistics.median(a for a, _ in got[without])
            second = statistics.median(b for _, b in got[without])
            label = "without (fallback)" if without else "with the internal"
            print(f"{name:9} {label:19} {first:10.2f} {second:10.2f}   ({unit}, medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
