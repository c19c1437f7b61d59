"""Broker clusters for the tests: start, kill -9 and restart single nodes through
``scripts/services.sh`` (``kafka-cluster-<n>`` / ``rabbitmq-cluster-<n>``), and run real
``mqdedup worker`` processes against them."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.services import IN_CI, REPO, SERVICES, require_service

MQDEDUP = str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "mqdedup")


def services(*args: str, timeout: float = 300) -> str:
    """``scripts/services.sh ARGS``; its stdout (raises with its output on failure)."""
    result = subprocess.run(
        ["bash", str(SERVICES), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"services.sh {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr[-4000:]}"
        )
    return result.stdout


@dataclass
class Cluster:
    """One of the clusters of ``scripts/services.d/clusters.sh`` (three nodes, 1..3)."""

    service: str  # kafka-cluster or rabbitmq-cluster
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    @contextlib.contextmanager
    def running(cls, service: str) -> Iterator[Cluster]:
        """Start the cluster (idempotent) for the block; stop it afterwards."""
        if os.geteuid() != 0:
            require_service(service, "scripts/services.sh needs root to start it")
        try:
            services("start", service, timeout=600)
        except RuntimeError as error:
            if IN_CI:
                raise
            require_service(service, str(error))
        env = dict(_exports(services("env")))
        try:
            yield cls(service, env)
        finally:
            services("stop", service, timeout=600)

    def kill(self, node: int) -> float:
        """SIGKILL node ``node``; returns the monotonic time of the kill."""
        started = time.monotonic()
        services("kill", f"{self.service}-{node}")
        return started

    def start_all(self) -> None:
        """Start the nodes that are down (idempotent; waits until all are back)."""
        services("start", self.service, timeout=600)

    def start(self, node: int) -> None:
        """Start node ``node`` again (with its data) and wait until it is back."""
        services("start", f"{self.service}-{node}", timeout=600)

    @property
    def kafka_bootstrap(self) -> str:
        return self.env["MQDEDUP_KAFKA_CLUSTER_BOOTSTRAP"]

    @property
    def rabbitmq_urls(self) -> list[str]:
        return self.env["MQDEDUP_RABBITMQ_CLUSTER_URLS"].split(",")

    @property
    def rabbitmq_nodes(self) -> list[str]:
        return self.env["MQDEDUP_RABBITMQ_CLUSTER_NODES"].split(",")


def _exports(text: str) -> Iterator[tuple[str, str]]:
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            words = shlex.split(value)
            yield name, words[0] if words else ""


class CliWorker:
    """A real ``mqdedup worker CONSUMER`` process (its own process group), output to a file."""

    def __init__(self, consumer: str, args: list[str], env: Mapping[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [MQDEDUP, "worker", consumer, *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def ensure_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise AssertionError(f"worker exited with {code}:\n{self.log_tail()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful stop); the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
