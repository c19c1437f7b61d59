"""A private RabbitMQ node for tests that change broker settings (never the shared one).

``private_node()`` starts a node with its own state dir and port and yields a
:class:`PrivateNode`: its URL, ``rabbitmqctl -n <node>``, and helpers to set broker
settings (``application:set_env``), raise and clear a memory alarm, and count the
connections of a client.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from random import Random

from tests.services import PrivateService


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_amqp_port() -> int:
    """A free AMQP port whose Erlang distribution port (+20000) is free too."""
    rng = Random()
    for _ in range(200):
        port = rng.randint(21000, 29999)
        if _port_free(port) and _port_free(port + 20000):
            return port
    raise RuntimeError("no free port pair for a private RabbitMQ node")


@dataclass
class PrivateNode:
    service: PrivateService
    url: str
    ctl: list[str]

    def run(self, *args: str) -> str:
        result = subprocess.run(
            [*self.ctl, *args], capture_output=True, text=True, timeout=60, check=True
        )
        return result.stdout

    def eval(self, expression: str) -> str:
        return self.run("eval", expression)

    def set_env(self, key: str, value: int) -> None:
        """``application:set_env(rabbit, key, value)`` (read by channels opened later)."""
        self.eval(f"application:set_env(rabbit, {key}, {value}).")

    def memory_alarm(self, on: bool) -> None:
        """Raise or clear this node's memory alarm (publishers are blocked while it is on)."""
        if on:
            self.eval("rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []}).")
        else:
            self.eval("rabbit_alarm:clear_alarm({resource_limit, memory, node()}).")

    def connections(self, name_part: str) -> list[str]:
        """``state`` of the connections whose client-provided name contains ``name_part``."""
        out = self.run("list_connections", "state", "client_properties", "-q", "--no-table-headers")
        return [
            line.split("\t", 1)[0]
            for line in out.splitlines()
            if "connection_name" in line and name_part in line
        ]

    def queue_messages(self, queue: str) -> int:
        """Ready + unacknowledged messages of ``queue`` (0 if it does not exist)."""
        out = self.run("list_queues", "name", "messages", "-q", "--no-table-headers")
        for line in out.splitlines():
            name, _, count = line.partition("\t")
            if name == queue:
                return int(count)
        return 0


@contextlib.contextmanager
def private_node(state_dir: Path) -> Iterator[PrivateNode]:
    """Start a RabbitMQ node of this test only; stop it afterwards."""
    port = _free_amqp_port()
    service = PrivateService("rabbitmq", state_dir / "services", "RABBITMQ_PORT", port)
    service.start()
    try:
        yield PrivateNode(
            service,
            f"amqp://guest:guest@127.0.0.1:{port}/%2F",
            ["/usr/sbin/rabbitmqctl", "-n", f"rabbit-{port}@localhost"],
        )
    finally:
        try:
            service.stop()
        except RuntimeError:
            service.kill()
