"""Consumers running inside a FastAPI app: tasks of its event loop, stopped on shutdown.

::

    from fastapi import FastAPI
    from mqdedup.fastapi import consumers_lifespan, consumers_health

    app = FastAPI(lifespan=consumers_lifespan(Shipments(), database=engine))
    app.include_router(consumers_health())          # GET /healthz/consumers

Each consumer runs ``await consumer.run_async(database, stop=token)`` as a task of the
app's loop (the one pipeline, inside the greenlet bridge: see ``docs/asyncio.md``). On
shutdown the stop is requested: each consumer finishes and settles its batch in flight
and closes its transport; after ``stop_timeout`` seconds the tasks are cancelled, which
stops them at their next await, settling nothing more (what did not commit is
redelivered). A consumer that ended with an error, is waiting out an outage, or has no
consumer attached at the broker makes the health route answer 503.

With a lifespan of your own, use :class:`ConsumerTasks` as an async context manager in it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from mqdedup.cli.health import snapshot_ready
from mqdedup.consumers.async_consumer import AsyncConsumer, Database
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)

#: Where :func:`consumers_lifespan` puts its :class:`ConsumerTasks` (``app.state.<name>``).
STATE_NAME = "mqdedup_consumers"


@dataclass
class _Running:
    consumer: AsyncConsumer
    metrics: Metrics
    task: asyncio.Task[Metrics] | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.consumer.consumer_name


@dataclass
class ConsumerTasks:
    """Consumers as tasks of the running event loop; an async context manager.

    ``database``: an ``AsyncEngine`` (recommended; ``mqdedup.create_async_engine``).
    ``stop_timeout``: seconds a graceful stop may take before the tasks are cancelled.
    """

    consumers: Sequence[AsyncConsumer]
    database: Database
    stop_timeout: float = 30.0
    stop: StopToken = field(default_factory=StopToken)
    _running: list[_Running] = field(default_factory=list, init=False)

    async def __aenter__(self) -> ConsumerTasks:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def __post_init__(self) -> None:
        for consumer in self.consumers:
            if not isinstance(consumer, AsyncConsumer):
                raise ConfigurationError(
                    f"{type(consumer).__name__} is not an AsyncConsumer: a synchronous "
                    "consumer would block the app's event loop (run it with mqdedup worker)"
                )

    def start(self) -> None:
        """Start one task per consumer on the running loop."""
        for consumer in self.consumers:
            running = _Running(consumer, Metrics())
            running.task = asyncio.create_task(
                consumer.run_async(self.database, stop=self.stop, metrics=running.metrics),
                name=f"mqdedup consumer {running.name}",
            )
            running.task.add_done_callback(functools.partial(self._ended, running))
            self._running.append(running)
            log.info("consumer started in the app", extra={"consumer": running.name})

    async def shutdown(self) -> None:
        """Stop gracefully (finish and settle the batches in flight), then cancel."""
        self.stop.request()
        tasks = [r.task for r in self._running if r.task is not None]
        if not tasks:
            return
        _done, late = await asyncio.wait(tasks, timeout=self.stop_timeout)
        for attempt in range(2):  # run_async: 1st cancel = graceful stop, 2nd = immediate
            if not late:
                break
            log.warning(
                "consumers did not stop in time, cancelling",
                extra={"consumers": len(late), "attempt": attempt + 1},
            )
            for task in late:
                task.cancel()
            _done, late = await asyncio.wait(late, timeout=5)
        log.info("consumers stopped", extra={"consumers": len(tasks)})

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, details)``: every consumer running, attached and not in an outage."""
        consumers: dict[str, Any] = {}
        ready = bool(self._running)
        for running in self._running:
            snapshot = running.metrics.snapshot(histograms=False)
            alive = running.task is not None and not running.task.done()
            ok = alive and snapshot_ready(snapshot)
            ready = ready and ok
            consumers[running.name] = {
                "running": alive,
                "ready": ok,
                "error": running.error,
                "outage": snapshot.get("outage"),
                "processed": snapshot.get("processed"),
                "duplicates": snapshot.get("duplicates"),
                "dead_lettered": snapshot.get("dead_lettered"),
            }
        return ready, {"consumers": consumers}

    def _ended(self, running: _Running, task: asyncio.Task[Metrics]) -> None:
        if task.cancelled():
            running.error = None if self.stop.requested else "cancelled"
            return
        error = task.exception()
        if error is not None:
            running.error = f"{type(error).__name__}: {error}"
            log.error(
                "consumer in the app failed",
                extra={"consumer": running.name, "error": running.error},
                exc_info=error,
            )
        elif not self.stop.requested:
            running.error = "stopped"


def consumers_lifespan(
    *consumers: AsyncConsumer,
    database: Database,
    stop_timeout: float = 30.0,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """A FastAPI ``lifespan`` running ``consumers`` for the app's lifetime.

    The :class:`ConsumerTasks` is ``app.state.mqdedup_consumers`` (what
    :func:`consumers_health` reports).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with ConsumerTasks(consumers, database, stop_timeout) as tasks:
            setattr(app.state, STATE_NAME, tasks)
            yield

    return lifespan


def consumers_health(path: str = "/healthz/consumers") -> APIRouter:
    """A router with ``GET <path>``: 200 when every consumer is ready, else 503 (JSON)."""
    router = APIRouter()

    @router.get(path, include_in_schema=False)
    async def consumers_ready(request: Request) -> JSONResponse:
        tasks: ConsumerTasks | None = getattr(request.app.state, STATE_NAME, None)
        if tasks is None:
            return JSONResponse({"ready": False, "consumers": {}}, status_code=503)
        ready, details = tasks.health()
        return JSONResponse({"ready": ready, **details}, status_code=200 if ready else 503)

    return router
