"""Work handed from the worker thread to the RabbitMQ I/O thread.

The worker thread queues a :class:`Command` and wakes the I/O thread with pika's
``add_callback_threadsafe`` (the only pika call that is safe from another thread); the
I/O thread runs it on its own connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Command:
    """Work for the I/O thread. The worker thread waits for it (bounded), unless it is
    ``detached`` (acks, nacks): then a failure is only logged by the I/O thread."""

    __slots__ = ("action", "description", "detached", "done", "error", "result")

    def __init__(
        self, action: Callable[[], Any], description: str = "", detached: bool = False
    ) -> None:
        self.action = action
        self.description = description
        self.detached = detached
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        """Run the action on the I/O thread, keeping its result or error."""
        try:
            self.result = self.action()
        except Exception as error:
            self.error = error
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        """Give up on a command that will never run (its connection closed)."""
        if not self.done.is_set():
            self.error = error
            self.done.set()


def noop() -> None:
    """Wakes the I/O loop."""
