"""Real HTTP servers for the key tests: a subprocess on a free port, ready when it answers."""

from __future__ import annotations

import contextlib
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.services import REPO, free_port, wait_for

#: Response bodies the endpoints return: valid UTF-8 with U+0000 (PostgreSQL's JSON cannot
#: hold that character), and bytes that are not UTF-8 at all.
BODIES = {"nul": "café\x00ok\x00".encode(), "bytes": b"\x00\xff\xfe\x80 end"}


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


def form_body(boundary: str, content: bytes, **fields: str) -> bytes:
    """A multipart/form-data body: the field ``note``, ``fields``, and a file ``upload``."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in {"note": "hello", **fields}.items()
    ]
    head = (
        "".join(parts) + f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="upload"; filename="a.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode() + content + f"\r\n--{boundary}--\r\n".encode()


__all__ = ["BODIES", "Server", "form_body", "free_port", "serving"]
