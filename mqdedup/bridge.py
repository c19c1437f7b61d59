"""Running the one synchronous pipeline on an asyncio event loop (the greenlet bridge).

Async consumers (``async def handle`` with an ``AsyncSession``) run through the same
Worker, Processor and transport as the synchronous ones: the pipeline runs inside a
greenlet on the event loop (:func:`run_bridged`), and every place where it would block
hands the loop an awaitable instead (:func:`wait_for`; the transport's blocking calls run
in a thread: :mod:`mqdedup.consumers.bridged_transport`). This
is the mechanism SQLAlchemy's own asyncio extension is built on
(``sqlalchemy.util.greenlet_spawn`` / ``await_``), so a ``Session`` on an
``AsyncEngine``'s ``sync_engine`` works inside the bridge unchanged.

Code that must not block the loop (transports, waits) checks :func:`in_bridge`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from mqdedup.errors import ConfigurationError

# SQLAlchemy's greenlet bridge (undocumented; why it is kept, the versions tested and the
# bound: docs/architecture.md, "Third-party internals"). Without it (a SQLAlchemy that
# moved it) async consumers refuse to start with one line; sync ones are unaffected.
try:
    from sqlalchemy.util.concurrency import await_, greenlet_spawn, in_greenlet

    SQLALCHEMY_BRIDGE = True
except ImportError:  # pragma: no cover (tests switch SQLALCHEMY_BRIDGE off)
    SQLALCHEMY_BRIDGE = False

T = TypeVar("T")
log = logging.getLogger(__name__)


class NotInBridgeError(RuntimeError):
    """:func:`wait_for` was called outside :func:`run_bridged` (no event loop to await on)."""


def in_bridge() -> bool:
    """True when running inside :func:`run_bridged` (on an event loop's greenlet)."""
    # Without greenlet loaded (the asyncio extra not installed or unused) there is no bridge.
    return SQLALCHEMY_BRIDGE and sys.modules.get("greenlet") is not None and in_greenlet()


def wait_for(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` from synchronous code running inside :func:`run_bridged`.

    The greenlet is suspended and the event loop runs (other tasks, heartbeats) until
    the awaitable completes; its result is returned, its exception raised. Outside the
    bridge it raises :class:`NotInBridgeError` (the awaitable is closed, never run).
    """
    if not in_bridge():
        close = getattr(awaitable, "close", None)
        if close is not None:  # a coroutine: no "never awaited" warning on top
            close()
        raise NotInBridgeError(
            "async code (an async consumer's handler, an async transport) must run on an "
            "event loop inside the bridge: use `await consumer.run_async(engine)`, "
            "`consumer.run(engine)` or `Worker(...).run()`, not the Processor directly"
        )
    return await_(awaitable)


def resolve(value: Awaitable[T] | T) -> T:
    """``value``, or what it resolves to when it is awaitable (an async handler's result)."""
    if inspect.isawaitable(value):
        return cast(T, wait_for(value))
    return value


def call_hook(hook: Callable[..., object], *args: Any) -> None:
    """Call a consumer's hook; an async consumer's (a coroutine) is awaited in the bridge."""
    result = hook(*args)
    if inspect.isawaitable(result):
        wait_for(result)


def call_hook_protected(hook: Callable[..., object], *args: Any, consumer: str, after: str) -> bool:
    """Call a consumer's hook (``after_commit``, ``on_duplicate``) whose messages' fate
    is already decided: what it raises is logged with ``consumer``, the hook's name and
    ``after`` (what happened before it), and goes no further. Returns False if it raised.

    The one way every hook is called, wherever from: a hook that raises never crashes
    the worker nor changes the fate of any message (it would otherwise be raised again
    on every redelivery of the batch).
    """
    try:
        call_hook(hook, *args)
    except Exception:
        log.exception(
            "a consumer hook failed after %s; the messages keep their fate",
            after,
            extra={"consumer": consumer, "hook": getattr(hook, "__name__", "hook")},
        )
        return False
    return True


async def run_bridged(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the synchronous ``fn`` on the running event loop, inside the bridge."""
    _require_greenlet()
    return await greenlet_spawn(fn, *args, **kwargs)


def _require_greenlet() -> None:
    if not SQLALCHEMY_BRIDGE:
        raise ConfigurationError(
            "async consumers need SQLAlchemy's greenlet bridge (sqlalchemy.util.concurrency), "
            "which this SQLAlchemy does not have: install the version mqdedup pins "
            "(pip install 'mqdedup[asyncio]')"
        )
    try:
        import greenlet  # type: ignore[import-untyped]  # noqa: F401  the asyncio extra
    except ImportError:
        raise ConfigurationError(
            "async consumers need greenlet, which is not installed: pip install 'mqdedup[asyncio]'"
        ) from None


def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the synchronous ``fn`` inside the bridge on a new event loop; block until done.

    For async code started from synchronous code (``consumer.run(...)``, a test). Inside
    a running event loop this is refused: await :func:`run_bridged` there instead.
    """
    if not _loop_running():
        return asyncio.run(run_bridged(fn, *args, **kwargs))
    raise NotInBridgeError(
        "an async consumer cannot be run synchronously from inside a running event loop: "
        "use `await consumer.run_async(engine)` / `await worker.run_async()`"
    )


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def sleep(seconds: float) -> None:
    """Sleep without blocking an event loop when inside the bridge (else a plain sleep)."""
    if in_bridge():
        wait_for(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)
