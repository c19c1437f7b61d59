"""Real HTTP servers for the key tests: a subprocess on a free port, ready when it answers."""

from __future__ import annotations

import contextlib
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.services import REPO, free_port, wait_for


@dataclass(frozen=True)
class Server:
    """A running server: its base URL and its log file (stdout and stderr)."""

    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:  # refused, or an HTTP error status (then it runs: good enough)
        return False


@contextlib.contextmanager
def serving(
    command: list[str], env: dict[str, str], log: Path, ready_path: str, port: int
) -> Iterator[Server]:
    """Run ``command`` (which listens on ``port``) until the block ends; SIGTERM then."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is not None or _answers(url + ready_path), 60, "the server")
        if process.poll() is not None:
            raise AssertionError(f"{command[:4]} exited:\n{log.read_text()[-3000:]}")
        yield Server(url, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


__all__ = ["Server", "free_port", "serving"]
