"""Start private service instances for outage tests (never the shared ones)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES = REPO / "scripts" / "services.sh"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class PrivateService:
    """One service instance of ``scripts/services.sh`` under its own state dir and port."""

    def __init__(self, service: str, state_dir: Path, port_variable: str, port: int) -> None:
        self.service = service
        self.port = port
        self.env = {**os.environ, "MQDEDUP_STATE_DIR": str(state_dir), port_variable: str(port)}

    def _run(self, action: str) -> None:
        result = subprocess.run(
            ["bash", str(SERVICES), action, self.service],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"services.sh {action} {self.service} failed:\n{result.stdout}\n{result.stderr}"
            )

    def start(self) -> None:
        self._run("start")

    def stop(self) -> None:
        self._run("stop")

    def kill(self) -> None:
        self._run("kill")
