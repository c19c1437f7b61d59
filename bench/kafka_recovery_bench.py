"""Seconds from "the broker is ready again" to "the first new message is processed".

A PRIVATE Kafka broker (its own port and state dir, started with
``scripts/services.sh``) serves one 3-partition topic; a mqdedup ``KafkaConsumer``
(SQLite dedup store, default settings unless ``--kafka-config`` is given) consumes it
in a thread. Each run: the worker is mid-consume, the broker is killed with SIGKILL,
stays down ``--outage`` seconds, is started again (``services.sh start`` returns once a
metadata request answers: "ready"), new messages are produced, and the clock stops when
the worker has processed the first of them. Medians are printed.

Usage::

    .venv/bin/python bench/kafka_recovery_bench.py --runs 3 --outage 20
    .venv/bin/python bench/kafka_recovery_bench.py --kafka-config \\
        '{"reconnect_backoff_max_ms": 30000, "request_timeout_ms": 30000}'  # old defaults

The shared broker is never touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kafka

from mqdedup import StopToken, create_engine, init_schema
from mqdedup.consumers.context import Context
from mqdedup.kafka import KafkaConsumer
from mqdedup.message import Message

SERVICES = Path(__file__).resolve().parent.parent / "scripts" / "services.sh"


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 65000:
            return port


class Broker:
    """A private broker driven through scripts/services.sh."""

    def __init__(self, state_dir: Path) -> None:
        self.port = free_port()
        self.env = {**os.environ, "MQDEDUP_STATE_DIR": str(state_dir), "KAFKA_PORT": str(self.port)}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, action: str) -> None:
        subprocess.run(
            ["bash", str(SERVICES), action, "kafka"],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=300,
        )


class Recorder(KafkaConsumer):
    """Records when each message id was handled."""

    seen: ClassVar[dict[str, float]] = {}
    delay: ClassVar[float] = 0.0

    def handle(self, message: Message, ctx: Context) -> Any:
        self.seen.setdefault(str(message.id), time.monotonic())
        if self.delay:
            time.sleep(self.delay)
        return None


def produce(bootstrap: str, topic: str, ids: list[str]) -> None:
    producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for message_id in ids:
        producer.send(
            topic,
            value=b"x",
            key=message_id.encode(),
            headers=[("message-id", message_id.encode())],
        )
    producer.flush(30)
    producer.close(5)


def wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--outage", type=float, default=20.0)
    parser.add_argument("--kafka-config", default="{}", help="JSON merged into kafka_config")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # connection errors are expected
    extra = json.loads(args.kafka_config)

    with tempfile.TemporaryDirectory(prefix="mqdedup-recovery-") as tmp:
        broker = Broker(Path(tmp) / "services")
        broker.run("start")
        engine = create_engine(f"sqlite:///{tmp}/dedup.db")
        init_schema(engine, "b_")
        topic = f"recovery-{uuid.uuid4().hex[:8]}"
        admin = kafka.KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics({topic: {"num_partitions": 3}}, wait_for_metadata=True)
        admin.close()
        produce(broker.bootstrap, topic, [f"warm-{i}" for i in range(300)])

        consumer = type(
            "Bench",
            (Recorder,),
            {
                "topics": [topic],
                "group_id": f"g-{topic}",
                "table_prefix": "b_",
                "bootstrap_servers": broker.bootstrap,
                "batch_size": 50,
                "kafka_config": extra,
            },
        )
        stop = StopToken()
        thread = threading.Thread(target=lambda: consumer().run(engine, stop=stop), daemon=True)
        thread.start()
        wait(lambda: len(Recorder.seen) >= 300, 120, "the warm-up messages")
        figures: list[float] = []
        try:
            for run in range(args.runs):
                broker.run("kill")
                time.sleep(args.outage)
                broker.run("start")
                ready = time.monotonic()
                ids = [f"after-{run}-{i}" for i in range(30)]
                produce(broker.bootstrap, topic, ids)
                wait(lambda ids=ids: any(i in Recorder.seen for i in ids), 300, "a new message")
                first = min(Recorder.seen[i] for i in ids if i in Recorder.seen)
                figures.append(first - ready)
                wait(lambda ids=ids: all(i in Recorder.seen for i in ids), 120, "every new message")
                print(f"run {run + 1}: {figures[-1]:.1f} s from broker ready to first new message")
        finally:
            stop.request()
            thread.join(30)
            broker.run("stop")
        print(
            f"median {statistics.median(figures):.1f} s over {len(figures)} runs "
            f"(outage {args.outage:.0f} s, kill -9; kafka_config overrides: {extra or 'none'})"
        )


if __name__ == "__main__":
    main()
