"""A progress line for long commands (``replay``, ``dedup purge``): one line on stderr,
rewritten in place (``\\r``) while the command runs, when stderr is a terminal; nothing
at all when it is not (a pipe, a file, cron), so scripts and logs only see the result."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

#: Seconds between two rewrites of the line.
INTERVAL = 0.2
_BAR = 30


class Progress:
    """One updating line ``label: [#####.....] done/total unit  12.3s`` (no bar when the
    total is unknown). Disabled (every call does nothing) unless ``stream`` is a
    terminal and ``enabled`` is True (``--quiet`` passes False)."""

    def __init__(
        self,
        stream: TextIO | None,
        label: str,
        *,
        unit: str = "",
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.label = label
        self.unit = unit
        self.enabled = enabled and stream is not None and _is_terminal(stream)
        self.clock = clock
        self._started = clock()
        self._written_at: float | None = None
        self._width = 0
        self._lock = threading.Lock()

    def update(self, done: int, total: int | None = None, *, force: bool = False) -> None:
        """Rewrite the line (at most every :data:`INTERVAL` seconds unless ``force``)."""
        if not self.enabled:
            return
        now = self.clock()
        with self._lock:
            if not force and self._written_at is not None and now - self._written_at < INTERVAL:
                return
            self._written_at = now
            self._write(self._line(done, total, now))

    def finish(self, done: int, total: int | None = None) -> None:
        """The final state of the line, then a newline (the result prints below it)."""
        if not self.enabled:
            return
        self.update(done, total, force=True)
        with self._lock:
            assert self.stream is not None
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def _line(self, done: int, total: int | None, now: float) -> str:
        unit = f" {self.unit}" if self.unit else ""
        elapsed = f"  {now - self._started:.1f}s"
        if total is None or total <= 0:
            return f"{self.label}: {done:,}{unit}{elapsed}"
        filled = min(_BAR, done * _BAR // total)
        bar = "#" * filled + "." * (_BAR - filled)
        return f"{self.label}: [{bar}] {done:,}/{total:,}{unit}{elapsed}"

    def _write(self, line: str) -> None:
        assert self.stream is not None
        padding = " " * max(0, self._width - len(line))  # wipe a longer previous line
        self._width = len(line)
        self.stream.write(f"\r{line}{padding}")
        self.stream.flush()


@contextmanager
def watching(progress: Progress, read: Callable[[], tuple[int, int | None]]) -> Iterator[None]:
    """Within the block, a thread rewrites ``progress`` from ``read()`` (done, total);
    on the way out the line gets its final state (not when it is disabled: no thread)."""
    if not progress.enabled:
        yield
        return
    done = threading.Event()

    def _watch() -> None:
        while not done.wait(INTERVAL):
            progress.update(*read())

    thread = threading.Thread(target=_watch, name="mqdedup-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=2)
        progress.finish(*read())


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
