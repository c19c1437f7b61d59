"""Kafka test helpers: topics, producing, offsets, reading topics, worker processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kafka
from kafka.structs import TopicPartition
from sqlalchemy import Engine, func, select

from tests.integration.kafka.consumers import orders_table

REPO = Path(__file__).resolve().parents[3]


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1
) -> None:
    """Poll ``condition`` until true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def unique_name(kind: str) -> str:
    return f"t-{kind}-{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Outgoing:
    """A message to produce: ``message_id=None`` sends no ``message-id`` header."""

    message_id: str | None
    body: bytes
    key: bytes | None = None
    partition: int | None = None


class KafkaHelper:
    """Topics and offsets on one broker; created topics are deleted at the end."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
        self.created: list[str] = []
        self._producer: Any = None

    def close(self, *, delete_topics: bool = True) -> None:
        """Disconnect; delete the topics this helper created unless told not to."""
        if self._producer is not None:
            self._producer.close(timeout=5)
        if not delete_topics:
            self.admin.close()
            return
        existing = set(self.admin.list_topics())
        doomed = [t for t in self.created if t in existing]
        doomed += [f"{t}.DLT" for t in self.created if f"{t}.DLT" in existing]
        if doomed:
            with contextlib.suppress(Exception):  # cleanup only
                self.admin.delete_topics(doomed, raise_errors=False)
        self.admin.close()

    def create_topic(
        self, partitions: int = 3, kind: str = "orders", name: str | None = None
    ) -> str:
        name = name or unique_name(kind)
        self.admin.create_topics({name: {"num_partitions": partitions}}, wait_for_metadata=True)
        self.created.append(name)
        return name

    @property
    def producer(self) -> Any:
        if self._producer is None:
            self._producer = kafka.KafkaProducer(
                bootstrap_servers=self.bootstrap, acks="all", linger_ms=5
            )
        return self._producer

    def produce(self, topic: str, messages: Iterable[Outgoing]) -> int:
        count = 0
        for message in messages:
            headers = (
                [] if message.message_id is None else [("message-id", message.message_id.encode())]
            )
            self.producer.send(
                topic,
                key=message.key,
                value=message.body,
                headers=headers,
                partition=message.partition,
            )
            count += 1
        self.producer.flush(timeout=60)
        return count

    def produce_positions(
        self, topic: str, messages: Iterable[Outgoing]
    ) -> dict[str, list[tuple[int, int]]]:
        """Produce and return ``message id -> [(partition, offset), ...]``."""
        sent = []
        for message in messages:
            headers = (
                [] if message.message_id is None else [("message-id", message.message_id.encode())]
            )
            future = self.producer.send(
                topic,
                key=message.key,
                value=message.body,
                headers=headers,
                partition=message.partition,
            )
            sent.append((message.message_id, future))
        self.producer.flush(timeout=60)
        positions: dict[str, list[tuple[int, int]]] = {}
        for message_id, future in sent:
            metadata = future.get(timeout=30)
            positions.setdefault(message_id or "", []).append((metadata.partition, metadata.offset))
        return positions

    def _consumer(self, group: str | None = None) -> Any:
        return kafka.KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )

    def end_offsets(self, topic: str) -> dict[int, int]:
        consumer = self._consumer()
        try:
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
            found = consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
            return {tp.partition: offset for tp, offset in found.items()}
        finally:
            consumer.close()

    def committed(self, group: str, topic: str) -> dict[int, int | None]:
        """The group's committed offset per partition (None: nothing committed)."""
        consumer = self._consumer(group)  # never subscribes: does not join the group
        try:
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
            return {p: consumer.committed(TopicPartition(topic, p)) for p in partitions}
        finally:
            consumer.close()

    def read_all(self, topic: str, expected: int, timeout: float = 30.0) -> list[Any]:
        """Every record of ``topic`` (waits until ``expected`` are there)."""
        consumer = self._consumer()
        try:
            wait_for(lambda: bool(consumer.partitions_for_topic(topic)), timeout, f"topic {topic}")
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            records: list[Any] = []
            deadline = time.monotonic() + timeout
            while len(records) < expected and time.monotonic() < deadline:
                for batch in consumer.poll(timeout_ms=200).values():
                    records.extend(batch)
            # Anything beyond the expected count must show up too.
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
            return records
        finally:
            consumer.close()


def row_counts(engine: Engine, prefix: str) -> dict[str, int]:
    """Business rows per message id."""
    table = orders_table(prefix)
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


def total_rows(engine: Engine, prefix: str) -> int:
    table = orders_table(prefix)
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


class WorkerProcess:
    """``python -m tests.integration.kafka.worker`` with one consumer spec."""

    def __init__(
        self, spec: Mapping[str, Any], database_url: str, workdir: Path, label: str
    ) -> None:
        self.label = label
        self.log_path = workdir / f"{label}.log"
        self.metrics_path = workdir / f"{label}.metrics.json"
        env = {
            **os.environ,
            "MQDEDUP_TEST_CONSUMER": json.dumps({**spec, "worker_label": label}),
            "MQDEDUP_TEST_DATABASE_URL": database_url,
            "MQDEDUP_TEST_METRICS": str(self.metrics_path),
            "PYTHONPATH": str(REPO),
        }
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.kafka.worker"],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, exactly like a crashed process."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self._log.close()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful stop) and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)
            self._log.close()
        return code

    def metrics(self) -> dict[str, Any]:
        return dict(json.loads(self.metrics_path.read_text()))

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def ensure_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise AssertionError(f"worker {self.label} exited with {code}:\n{self.log_tail()}")
