"""Kafka test helpers: business rows and worker processes (topics and producing:
``tests.services.KafkaHelper``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from tests.services import REPO, wait_for
from tests.support import orders_table


def row_counts(engine: Engine, prefix: str) -> dict[str, int]:
    """Business rows per message id."""
    table = orders_table(prefix)
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: row[1] for row in rows}


def run_until_parked(consumer: Any, db: Any, good: list[str]) -> tuple[Any, Any]:
    """Run ``consumer`` in a thread until ``good`` are written and one dead letter the
    broker refused is parked in the database (``db``: a test database with ``engine``
    and ``prefix``); stop it. Returns (the parked dead letter, the run's metrics)."""
    from mqdedup.dedup.dead_letters import DeadLetterTable
    from mqdedup.stopping import StopToken

    parked_table = DeadLetterTable(db.prefix)

    def parked() -> list[Any]:
        with Session(db.engine) as session:
            return parked_table.list(session)

    stop = StopToken()
    outcome: list[Any] = []
    runner = threading.Thread(
        target=lambda: outcome.append(consumer.run(db.engine, stop=stop)), daemon=True
    )
    runner.start()
    try:
        wait_for(
            lambda: len(parked()) == 1 and len(row_counts(db.engine, db.prefix)) == len(good),
            60,
            "the good messages written and the refused dead letter parked",
        )
    finally:
        stop.request()
        runner.join(60)
    assert not runner.is_alive() and len(outcome) == 1, outcome
    [kept] = parked()
    return kept, outcome[0]


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
