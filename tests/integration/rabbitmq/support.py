"""Parts of the RabbitMQ integration tests: test consumers, a broker admin, worker runners."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import Engine, Table, func, insert, select

from mqdedup import Message
from mqdedup.consumers.context import Context
from mqdedup.consumers.metrics import Metrics
from mqdedup.db.schema import schema
from mqdedup.rabbitmq.consumer import RabbitMQConsumer, RabbitMQTransport
from mqdedup.stopping import StopToken
from tests.services import REPO, wait_for
from tests.support import orders_table

# -- business table ------------------------------------------------------------------------


def order_counts(engine: Engine, table: Table) -> dict[str, int]:
    """Business rows per message id."""
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


def row_count(engine: Engine, table: Table) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def claims(engine: Engine, prefix: str, consumer: str) -> set[str]:
    """Message ids with a committed dedup claim for ``consumer``."""
    processed = schema(prefix).processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(processed.c.message_id).where(processed.c.consumer_name == consumer)
        )
        return {row[0] for row in rows}


def attempts(engine: Engine, prefix: str, consumer: str, message_id: str) -> int | None:
    table = schema(prefix).attempts
    with engine.connect() as connection:
        value = connection.execute(
            select(table.c.attempts).where(
                table.c.consumer_name == consumer, table.c.message_id == message_id
            )
        ).scalar_one_or_none()
    return None if value is None else int(value)


# -- test consumers -----------------------------------------------------------------------


class OrdersConsumer(RabbitMQConsumer):
    """Writes one row per message to ``orders``; records what happened for the test.

    ``before_write`` is a hook tests set (gates, sleeps, failures); ``duplicate_ids``
    lists the duplicates the processor reported; ``transport`` is the live transport.
    """

    orders: ClassVar[Table]
    batch_size = 100
    poll_timeout = 0.2
    before_write: ClassVar[Callable[[Message], None] | None] = None

    def __init__(self) -> None:
        self.transport: RabbitMQTransport | None = None
        self.calls: Counter[str] = Counter()
        self.duplicate_ids: list[str] = []
        self.duplicate_messages: list[Message] = []

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> RabbitMQTransport:
        self.transport = super().create_transport(stop=stop, metrics=metrics)
        return self.transport

    def handle(self, message: Message, ctx: Context) -> Any:
        assert message.id is not None
        self.calls[message.id] += 1
        hook = type(self).before_write
        if hook is not None:
            hook(message)
        ctx.session.execute(
            insert(self.orders).values(message_id=message.id, body=message.text()[:2000])
        )
        return None

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        assert message.id is not None
        self.duplicate_ids.append(message.id)
        self.duplicate_messages.append(message)


def make_consumer(queue: str, prefix: str, url: str, **attributes: Any) -> type[OrdersConsumer]:
    """A consumer class for ``queue`` writing to ``<prefix>orders`` with its own tables."""
    namespace: dict[str, Any] = {
        "queue": queue,
        "url": url,
        "table_prefix": prefix,
        "orders": orders_table(prefix),
        "connection_name": f"mqdedup-test:{queue}",
        **attributes,
    }
    hook = namespace.get("before_write")
    if hook is not None:
        namespace["before_write"] = staticmethod(hook)
    return type(f"Orders_{queue.replace('-', '_')}", (OrdersConsumer,), namespace)


# -- broker admin ------------------------------------------------------------------------


@dataclass
class Published:
    """What a test published: every message id (with copies) and the unique ones."""

    ids: list[str]

    @property
    def unique(self) -> set[str]:
        return set(self.ids)

    @property
    def copies(self) -> int:
        return len(self.ids) - len(self.unique)


def with_duplicates(
    count: int, duplicate_share: float, prefix: str = "m", seed: int = 7
) -> list[str]:
    """``count`` message ids of which ``duplicate_share`` repeat an earlier id.

    Each copy lands at a random later position (near or far: same batch or later).
    """
    rng = random.Random(seed)
    copies = round(count * duplicate_share)
    ids = [f"{prefix}{number:06d}" for number in range(count - copies)]
    for _ in range(copies):
        original = rng.randrange(len(ids))
        position = rng.randint(original + 1, len(ids))
        ids.insert(position, ids[original])
    return ids


# -- rabbitmqctl -------------------------------------------------------------------------


def rabbitmqctl_command() -> list[str] | None:
    """The ``rabbitmqctl -n <node>`` command of the shared node (MQDEDUP_RABBITMQCTL)."""
    value = os.environ.get("MQDEDUP_RABBITMQCTL")
    return shlex.split(value) if value else None


def rabbitmqctl(ctl: Sequence[str], *arguments: str) -> str:
    """Run ``rabbitmqctl`` (``ctl``: :func:`rabbitmqctl_command`); its standard output."""
    return subprocess.run(
        [*ctl, *arguments], capture_output=True, text=True, timeout=60, check=True
    ).stdout


def connection_pids(ctl: Sequence[str], connection_name: str) -> list[str]:
    """Broker pids of the connections whose client-provided name is ``connection_name``."""
    return pids_matching(ctl, f'{{"connection_name","{connection_name}"}}')


def pids_matching(ctl: Sequence[str], part: str) -> list[str]:
    """Broker pids of the connections whose client properties contain ``part``."""
    listed = rabbitmqctl(
        ctl, "list_connections", "pid", "client_properties", "-q", "--no-table-headers"
    )
    return [line.split("\t", 1)[0] for line in listed.splitlines() if part in line]


def close_connections(ctl: Sequence[str], connection_name: str, reason: str) -> int:
    """Close (broker side) only the connections named ``connection_name``; return how many."""
    pids = connection_pids(ctl, connection_name)
    for pid in pids:
        rabbitmqctl(ctl, "close_connection", pid, reason)
    return len(pids)


def connection_heartbeat(ctl: Sequence[str], connection_name: str) -> list[int]:
    """Negotiated heartbeat timeouts (seconds) of the connections named ``connection_name``."""
    listed = rabbitmqctl(
        ctl, "list_connections", "timeout", "client_properties", "-q", "--no-table-headers"
    )
    marker = f'{{"connection_name","{connection_name}"}}'
    return [int(line.split("\t", 1)[0]) for line in listed.splitlines() if marker in line]


# -- running workers ---------------------------------------------------------------------


class ThreadedWorker:
    """``consumer.run(engine, stop=...)`` in a thread: the production entry point, observable."""

    def __init__(self, consumer: OrdersConsumer, engine: Engine) -> None:
        self.consumer = consumer
        self.engine = engine
        self.stop = StopToken()
        self.metrics = Metrics()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-worker", daemon=True)

    def _run(self) -> None:
        try:
            self.consumer.run(self.engine, stop=self.stop, metrics=self.metrics)
        except BaseException as error:
            self.error = error

    @property
    def transport(self) -> RabbitMQTransport:
        assert self.consumer.transport is not None
        return self.consumer.transport

    def start(self) -> ThreadedWorker:
        self.thread.start()
        wait_for(
            lambda: (
                self.error is not None
                or (self.consumer.transport is not None and self.consumer.transport.connected)
            ),
            60,
            "the worker to connect",
        )
        if self.error is not None:
            raise self.error
        return self

    def finish(self, timeout: float = 60) -> Metrics:
        """Request a graceful stop and wait for the worker to return."""
        self.stop.request()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error is not None:
            raise self.error
        return self.metrics

    def __enter__(self) -> ThreadedWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.stop.request()
            self.thread.join(60)


@dataclass
class WorkerProcess:
    """A worker in a subprocess (``worker_main``), for kill -9 and signal tests."""

    process: subprocess.Popen[str]

    @classmethod
    def start(cls, config: dict[str, Any]) -> WorkerProcess:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.rabbitmq.worker_main", json.dumps(config)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return cls(process)

    def wait(self, timeout: float) -> tuple[int, dict[str, Any]]:
        """Exit code and the JSON report the worker printed (empty if it printed none)."""
        try:
            stdout, stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            stdout, stderr = self.process.communicate()
            raise AssertionError(f"worker did not exit within {timeout}s:\n{stderr[-3000:]}")
        report: dict[str, Any] = {}
        for line in stdout.splitlines():
            if line.startswith("{"):
                report = json.loads(line)
        self.stderr = stderr
        return self.process.returncode, report

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def poll(seconds: float, check: Callable[[], None], interval: float = 0.5) -> None:
    """Keep asserting ``check`` for ``seconds`` (an outage's length), failing at once."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        check()
        time.sleep(interval)
    check()


def read_marker(path: Path) -> str | None:
    return path.read_text() if path.exists() else None
