"""A synchronous transport driven from an event loop: how async consumers use the one
transport of their broker.

Kafka's and RabbitMQ's transports own their I/O threads (the poll thread keeps the group
membership, the pika I/O thread answers heartbeats), so nothing has to run on the event
loop for the connection to stay alive. What remains are the calls the worker makes into
the transport, some of which block: ``fetch`` waits for deliveries, ``dead_letter`` waits
for the broker's confirm, ``close`` waits for the last commit and the I/O thread, and
``start`` for the first connection. Inside the greenlet bridge (:mod:`mqdedup.bridge`)
:class:`BridgedTransport` runs each of them in a worker thread of its own and awaits the
result, so the loop's other tasks keep running; outside the bridge it calls the transport
directly. One adapter for every transport: no broker code here.

Stops keep their bounds: a stop request (``task.cancel()`` on ``run_async``) is seen by
the transport itself (``fetch`` returns nothing within its poll slice, ``start`` gives up
connecting), so the awaited call ends as it does for a synchronous worker. A second
cancel ends the await at once; the call still running in its thread finishes on its own
and ``close`` (which every transport makes safe against a concurrent ``fetch``) follows.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from mqdedup.bridge import in_bridge, wait_for
from mqdedup.consumers.transport import DeadLetter, Delivery, TokenT, Transport

T = TypeVar("T")

#: Threads of one transport's executor: the worker's call in flight, plus ``close`` when
#: a second cancel abandoned that call (it finishes in the background).
THREADS = 2


class BridgedTransport(Generic[TokenT]):
    """A :class:`~mqdedup.consumers.transport.Transport` that runs ``inner``'s blocking
    calls in a thread when called inside the bridge (see the module docs).

    ``inner`` is the started synchronous transport; it stays reachable as :attr:`inner`.
    """

    def __init__(self, inner: Transport[TokenT], executor: ThreadPoolExecutor | None = None):
        #: The synchronous transport doing the work.
        self.inner = inner
        #: The inner transport's stored positions, if any (see :mod:`.positions`).
        self.positions = getattr(inner, "positions", None)
        self._executor = executor or _executor(type(inner).__name__)
        self._shut = False

    @classmethod
    def start(
        cls, start: Callable[[], Transport[TokenT]], *, name: str = "transport"
    ) -> BridgedTransport[TokenT]:
        """``start()`` (connect, join, declare: a started transport), run in a thread
        inside the bridge, wrapped. ``start`` must give up when its stop token is
        requested (every transport's ``start`` does). A start whose await was abandoned
        (a second cancel) closes the transport it started, in its thread."""
        executor = _executor(name)
        lock = threading.Lock()
        state: dict[str, Any] = {"abandoned": False, "started": None}

        def guarded() -> Transport[TokenT]:
            transport = start()
            with lock:
                state["started"] = transport
                abandoned = state["abandoned"]
            if abandoned:
                transport.close()
            return transport

        try:
            inner = _call(executor, guarded)
        except BaseException:
            with lock:
                state["abandoned"] = True
                started = state["started"]
            if started is not None:  # started meanwhile: nobody else will close it
                executor.submit(started.close)
            executor.shutdown(wait=False)
            raise
        return cls(inner, executor)

    def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery[TokenT]]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` seconds."""
        return _call(self._executor, self.inner.fetch, max_messages, timeout)

    def settle(self, deliveries: Sequence[Delivery[TokenT]]) -> None:
        """Acknowledge / commit the offsets of deliveries that are done."""
        _call(self._executor, self.inner.settle, deliveries)

    def give_back(self, deliveries: Sequence[Delivery[TokenT]]) -> None:
        """Return unsettled deliveries to the source: they are fetched again."""
        _call(self._executor, self.inner.give_back, deliveries)

    def dead_letter(self, delivery: Delivery[TokenT], record: DeadLetter) -> None:
        """Store the original message with ``record`` durably (broker confirm), or raise."""
        _call(self._executor, self.inner.dead_letter, delivery, record)

    def keepalive(self) -> None:
        """The inner transport's (its I/O thread keeps the connection: nothing blocks)."""
        self.inner.keepalive()

    def close(self) -> None:
        """Close the inner transport (in a thread inside the bridge), then the threads."""
        if self._shut:
            return
        self._shut = True
        try:
            _call(self._executor, self.inner.close)
        finally:
            self._executor.shutdown(wait=False)

    @property
    def closed(self) -> bool:
        """The inner transport's ``closed`` (False if it has none)."""
        return bool(getattr(self.inner, "closed", False))


def _executor(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix=f"mqdedup-bridged[{name}]")


def _call(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in ``executor``, awaited, inside the bridge; else directly."""
    if not in_bridge():
        return fn(*args)
    context = contextvars.copy_context()  # log context and tracing spans follow the call
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, functools.partial(context.run, fn, *args))
    return wait_for(future)
