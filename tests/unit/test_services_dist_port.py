"""The services script's Erlang distribution port for a RabbitMQ node (issue #40): never a
port someone holds, never in the kernel's ephemeral range (where an outgoing connection can
take it before the node binds it, and the node fails with ``dist_port_already_used``)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from tests.services import REPO

SCRIPT = REPO / "scripts" / "services.sh"


def ephemeral() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def pick(amqp_port: int, *taken: int) -> int:
    out = subprocess.run(
        ["bash", str(SCRIPT), "dist-port", str(amqp_port), *map(str, taken)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.strip())


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def outside_range(port: int) -> bool:
    low, high = ephemeral()
    return not low <= port <= high


def test_the_candidate_port_taken_picks_another_free_one_outside_the_ephemeral_range() -> None:
    low, _ = ephemeral()
    # An AMQP port whose +20000 candidate lies below the ephemeral range, held by a socket
    # with an outgoing connection's kind of binding (not listening).
    amqp = next(p for p in range(5700, 6600) if p + 20000 < low and bindable(p + 20000))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", amqp + 20000))
        chosen = pick(amqp)
    assert chosen != amqp + 20000
    assert outside_range(chosen) and bindable(chosen)
    assert pick(amqp, chosen) != chosen  # a port promised to a sibling node is skipped


def test_a_candidate_in_the_ephemeral_range_is_never_chosen() -> None:
    low, high = ephemeral()
    amqp = max(1025, low - 20000)  # an AMQP port whose +20000 is in the range
    assert low <= amqp + 20000 <= high
    chosen = pick(amqp)
    assert outside_range(chosen) and bindable(chosen)
