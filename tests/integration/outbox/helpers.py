"""Parts of the outbox integration tests: tables, broker tools, writers, relay processes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, func, select
from sqlalchemy.orm import Session

from mqdedup.outbox import OutboxStatus, OutboxStore, OutboxWriter, Relay, RelayMetrics
from mqdedup.stopping import StopToken
from tests.services import REPO, TestDatabase, wait_for


def events_table(prefix: str) -> Table:
    """``<prefix>events``: one row per handled message; no unique constraint on purpose."""
    return Table(
        f"{prefix}events",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("consumer", String(64), nullable=False),
        Column("message_id", String(255), nullable=False),
        Column("body", String(2000), nullable=True),
    )


@dataclass(frozen=True)
class OutboxDb(TestDatabase):
    """A shared database with this test's table prefix and business table."""

    events: Table

    def status(self) -> OutboxStatus:
        return OutboxStore(self.prefix).status(self.engine)

    def event_counts(self, consumer: str) -> Counter[str]:
        """Business rows per message id written by ``consumer``."""
        table = self.events
        with self.engine.connect() as connection:
            rows = connection.execute(
                select(table.c.message_id, func.count())
                .where(table.c.consumer == consumer)
                .group_by(table.c.message_id)
            ).all()
        return Counter({row[0]: int(row[1]) for row in rows})

    def outbox_ids(self) -> set[str]:
        table = OutboxStore(self.prefix).table
        with self.engine.connect() as connection:
            return set(connection.execute(select(table.c.message_id)).scalars())


# -- writing outbox rows -------------------------------------------------------------------


def write_keyed_rows(
    db: OutboxDb,
    destination: dict[str, Any],
    *,
    keys: int,
    per_key: int,
    threads: int,
    seed: int = 3,
) -> dict[str, list[str]]:
    """Write ``keys * per_key`` outbox rows from ``threads`` concurrent transaction streams.

    Each key belongs to one thread, which writes its rows in sequence order, 1 to 5 rows
    per transaction (mixing its keys), so a key's commit order is its sequence order.
    Payload: ``{"key": ..., "seq": ...}``. Returns the message ids of each key in order.
    """
    written: dict[str, list[str]] = {f"k{k:04d}": [] for k in range(keys)}
    errors: list[BaseException] = []

    def stream(index: int) -> None:
        rng = random.Random(seed + index)
        mine = [key for n, key in enumerate(written) if n % threads == index]
        queue = [(key, seq) for seq in range(per_key) for key in mine]
        try:
            while queue:
                size = rng.randint(1, 5)
                take, queue = queue[:size], queue[size:]
                with Session(db.engine) as session, session.begin():
                    writer = OutboxWriter(session, prefix=db.prefix)
                    for key, seq in take:
                        message_id = writer.publish(
                            {"key": key, "seq": seq}, key=key, **destination
                        )
                        written[key].append(message_id)
        except BaseException as error:
            errors.append(error)

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert not errors, errors
    return written


def order_problems(sequence: Sequence[tuple[str, int]]) -> list[str]:
    """``(key, seq)`` pairs in delivery order: report keys whose first deliveries go back.

    Repeats (at-least-once) are allowed; a key's *first* occurrences must come in
    sequence order.
    """
    last: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    problems = []
    for key, seq in sequence:
        if (key, seq) in seen:
            continue
        seen.add((key, seq))
        if seq < last.get(key, -1):
            problems.append(f"{key}: seq {seq} after {last[key]}")
        last[key] = max(seq, last.get(key, -1))
    return problems


# -- running relays ------------------------------------------------------------------------


@contextlib.contextmanager
def relay_thread(relay: Relay) -> Iterator[tuple[StopToken, list[RelayMetrics]]]:
    """Run ``relay.run`` in a thread; stop it (gracefully) when the block ends."""
    stop = StopToken()
    result: list[RelayMetrics] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(relay.run(stop))
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=target, name="relay")
    thread.start()
    try:
        yield stop, result
    finally:
        stop.request()
        thread.join(timeout=60)
    assert not thread.is_alive(), "relay did not stop"
    assert not errors, errors


class WorkerProcess:
    """``python -m <module> <config>`` with its output collected (relay or consumer)."""

    module = "tests.integration.outbox.chain_worker"

    def __init__(self, config: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, json.dumps(config)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def saw(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for line in list(self.lines))

    def value_of(self, prefix: str) -> str:
        """The text after ``prefix`` on the first output line starting with it."""
        for line in list(self.lines):
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(f"no line {prefix!r} in:\n{self.tail()}")

    def wait_for_line(self, prefix: str, timeout: float) -> None:
        def seen() -> bool:
            if self.process.poll() is not None and not self.saw(prefix):
                raise AssertionError(f"{self.module} exited:\n{self.tail()}")
            return self.saw(prefix)

        wait_for(seen, timeout, f"output {prefix!r} of {self.module}")

    def kill(self) -> None:
        """SIGKILL: no batch is finished, nothing is marked, no lock is released cleanly."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """SIGTERM (graceful) and the metrics the process printed."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        assert self.process.returncode == 0, self.tail()
        for line in reversed(self.lines):
            if line.startswith("METRICS "):
                return dict(json.loads(line[len("METRICS ") :]))
        raise AssertionError(f"no metrics printed:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.lines[-lines:])


class RelayProcess(WorkerProcess):
    """``python -m tests.integration.outbox.relay_main <config>``."""

    module = "tests.integration.outbox.relay_main"


def poll_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """``wait_for`` with a coarser interval, for conditions that query services."""
    wait_for(condition, timeout, what, interval=0.2)
