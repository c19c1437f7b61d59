"""Running the one synchronous pipeline on an asyncio event loop (the greenlet bridge).

Async consumers (aiokafka / aio-pika transports, ``async def handle`` with an
``AsyncSession``) run through the same Worker and Processor as the synchronous ones:
the pipeline runs inside a greenlet on the event loop (:func:`run_bridged`), and every
place where it would block hands the loop an awaitable instead (:func:`wait_for`). This
is the mechanism SQLAlchemy's own asyncio extension is built on
(``sqlalchemy.util.greenlet_spawn`` / ``await_``), so a ``Session`` on an
``AsyncEngine``'s ``sync_engine`` works inside the bridge unchanged.

Code that must not block the loop (transports, waits) checks :func:`in_bridge`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.util.concurrency import await_, greenlet_spawn, in_greenlet

T = TypeVar("T")


def in_bridge() -> bool:
    """True when running inside :func:`run_bridged` (on an event loop's greenlet)."""
    # Without greenlet loaded (the asyncio extra not installed or unused) there is no bridge.
    return "greenlet" in sys.modules and in_greenlet()


def wait_for(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` from synchronous code running inside :func:`run_bridged`.

    The greenlet is suspended and the event loop runs (other tasks, heartbeats) until
    the awaitable completes; its result is returned, its exception raised.
    """
    return await_(awaitable)


async def run_bridged(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the synchronous ``fn`` on the running event loop, inside the bridge."""
    return await greenlet_spawn(fn, *args, **kwargs)


def sleep(seconds: float) -> None:
    """Sleep without blocking an event loop when inside the bridge (else a plain sleep)."""
    if in_bridge():
        wait_for(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)
