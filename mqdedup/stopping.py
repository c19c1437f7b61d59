"""Stop requests and signal handling for workers (as a context manager)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

from mqdedup.bridge import in_bridge, run_bridged, sleep

T = TypeVar("T")

log = logging.getLogger(__name__)


class ImmediateStop(BaseException):
    """Raised in the main thread by a second SIGTERM/SIGINT: stop now, settle nothing more."""


class StopWhileWaiting(BaseException):
    """A stop signal arrived while the main thread waited in an :func:`abandoned_on_stop`
    block (a step waiting for a connection): the wait is abandoned, the batch in flight
    rolled back and given back unsettled (never dead-lettered, never acked).

    A ``BaseException``: a handler's ``except Exception`` does not keep it, and
    SQLAlchemy invalidates a connection whose statement it interrupted."""


#: Per thread: how many :func:`abandoned_on_stop` blocks it is in (``depth``), and how
#: many stops were requested in it (``requests``, for :func:`abandon_on_stop`).
_waiting = threading.local()

#: How often :func:`abandon_on_stop` looks for a stop while its awaitable runs.
STOP_CHECK_SECONDS = 0.05


@contextmanager
def abandoned_on_stop(what: str) -> Iterator[None]:
    """Within the block, a stop requested *in this thread* (a signal handler runs in the
    main thread, interrupting the wait it is in) raises :class:`StopWhileWaiting` there.

    For waits that may outlast a shutdown timeout (a pool checkout, a pooler's queue).
    A stop requested before the block, or from another thread, does not interrupt it.
    """
    depth = getattr(_waiting, "depth", 0)
    _waiting.depth = depth + 1
    _waiting.what = what
    try:
        yield
    finally:
        _waiting.depth = depth


def _stops_here() -> int:
    return int(getattr(_waiting, "requests", 0))


async def abandon_on_stop(awaitable: Awaitable[T], what: str) -> T:
    """Await ``awaitable``; a stop requested in this thread while it runs (a signal
    handler, in the event loop's thread; a cancelled :func:`run_stoppable`) cancels it
    and raises :class:`StopWhileWaiting`.

    :func:`abandoned_on_stop` for the event loop, which a signal handler must not
    interrupt: the awaitable runs as a task, the stop is looked for every
    ``STOP_CHECK_SECONDS``. A stop requested before, or from another thread, does not
    end it. For waits that may outlast a shutdown timeout (an async pool's checkout, a
    pooler's queue).
    """
    task = asyncio.ensure_future(awaitable)
    seen = _stops_here()
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=STOP_CHECK_SECONDS)
            if not task.done() and _stops_here() != seen:
                task.cancel()
                await asyncio.wait({task})
                if not task.cancelled():
                    task.exception()  # retrieved: what it raised meanwhile is moot
                raise StopWhileWaiting(f"stop requested while {what}")
    finally:
        if not task.done():  # we were cancelled: so is the wait
            task.cancel()
    return task.result()


class StopToken:
    """A graceful-stop request shared by a worker and whoever wants to stop it."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def requested(self) -> bool:
        """True once a stop was requested."""
        return self._event.is_set()

    def request(self) -> None:
        """Ask the worker to finish its batch in flight and stop.

        Called in a thread waiting in an :func:`abandoned_on_stop` block (a signal
        handler interrupting it), it raises :class:`StopWhileWaiting` to end that wait.
        """
        self._event.set()
        _waiting.requests = _stops_here() + 1
        if getattr(_waiting, "depth", 0):
            raise StopWhileWaiting(f"stop requested while {_waiting.what}")

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return True early if a stop is requested.

        Inside the asyncio bridge (async consumers) the event loop keeps running while
        waiting: the stop flag is checked every 50 ms between loop sleeps.
        """
        if not in_bridge():
            return self._event.wait(seconds)
        deadline = time.monotonic() + seconds
        while not self._event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            sleep(min(remaining, 0.05))
        return True


@contextmanager
def graceful_signals(stop: StopToken) -> Iterator[StopToken]:
    """Within the block, SIGTERM/SIGINT request a graceful stop; a second one stops at once.

    Previous handlers are restored on exit. Outside the main thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def _handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.requested:
            log.warning("second stop signal: stopping at once", extra={"signal": name})
            raise ImmediateStop(name)
        log.info("stop signal: finishing the batch in flight", extra={"signal": name})
        stop.request()

    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def run_stoppable(stop: StopToken, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run the synchronous ``fn`` (a worker loop watching ``stop``) inside the bridge.

    Cancelling the task awaiting this requests a graceful stop instead of interrupting
    ``fn``: it is awaited to its end (the batch in flight committed and settled, the
    transport closed), then ``CancelledError`` propagates. A second cancel while
    draining is passed on to ``fn``: it stops at its next await, settling nothing more.
    """
    inner = asyncio.ensure_future(run_bridged(fn, *args, **kwargs))
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        if inner.done():
            raise
        log.info("task cancelled: finishing the batch in flight")
        stop.request()
        await inner  # cancelling us again cancels ``inner`` (an immediate stop)
        raise
