"""The stop line of ``worker`` / ``relay`` adds up every child process's last counts,
restarted ones included, and says them in order."""

from __future__ import annotations

from typing import Any

from mqdedup.cli.lifecycle import WORKER_COUNTS, stop_line, sum_counters
from mqdedup.cli.supervisor import ChildSpec, Supervisor


class _Process:
    pid = 4242
    sentinel = 0

    def start(self) -> None:
        return None


class _Context:
    """Starts nothing: what the supervisor's bookkeeping sees of a spawned child."""

    def Pipe(self, duplex: bool = False) -> tuple[Any, Any]:
        class _End:
            def close(self) -> None:
                return None

        return _End(), _End()

    def Process(self, **_options: Any) -> _Process:
        return _Process()


def test_a_restarted_child_keeps_its_earlier_counts_in_the_totals() -> None:
    specs = [ChildSpec("orders", index, "x:y") for index in range(2)]
    supervisor = Supervisor(specs)
    supervisor._context = _Context()  # type: ignore[assignment]
    first, second = supervisor.children
    for child in supervisor.children:
        supervisor._start(child)
    first.snapshot = {"processed": 100, "duplicates": 3, "process": {"rss": 1}}
    second.snapshot = {"processed": 50, "dead_lettered": 1}
    supervisor._start(first)  # the first child died and is restarted
    assert first.snapshot == {}  # the new process has reported nothing yet
    first.snapshot = {"processed": 7}
    totals = sum_counters(supervisor.history())
    assert totals == {"processed": 157, "duplicates": 3, "dead_lettered": 1}
    line = stop_line("worker", 0, 12.34, totals, WORKER_COUNTS)
    assert line == (
        "mqdedup worker: stopped (exit 0) after 12.3s: 157 processed, 3 duplicates, "
        "1 dead-lettered, 0 handler failures"
    )
