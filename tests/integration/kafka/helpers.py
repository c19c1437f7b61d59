"""Kafka test helpers: business rows and worker processes (topics and producing:
``tests.services.KafkaHelper``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select

from tests.services import REPO
from tests.support import orders_table


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
