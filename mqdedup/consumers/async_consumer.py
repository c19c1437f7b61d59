"""Async consumers: ``async def handle`` with an ``AsyncSession``, on the one pipeline.

An :class:`AsyncConsumer` runs through the same Worker and Processor as every other
consumer (claim -> handle -> commit -> settle, retries, dead letters, stored results),
on an event loop: the pipeline runs inside the greenlet bridge (:mod:`mqdedup.bridge`)
and awaits where it would block (the database driver, the transport, backoffs), so the
loop's other tasks keep running. Subclass it together with a broker's consumer class,
or use an async transport's class (``AsyncKafkaConsumer`` / ``AsyncRabbitMQConsumer``)::

    class Orders(AsyncConsumer):
        async def handle(self, message, ctx):
            await ctx.session.execute(insert(orders).values(id=message.json()["id"]))
            await ctx.outbox.publish({"order": message.id}, topic="order-events")

    await Orders().run_async(async_engine, stop=token)   # inside your event loop
    Orders().run(engine)                                 # or its own (mqdedup worker)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import Engine

from mqdedup.bridge import in_bridge, run_blocking, wait_for
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import AsyncBatchContext, AsyncContext
from mqdedup.consumers.metrics import Metrics
from mqdedup.db.async_engine import create_async_engine
from mqdedup.stopping import StopToken, run_stoppable

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.orm import Session, sessionmaker

    from mqdedup.message import Message

    Database = Engine | AsyncEngine | sessionmaker[Session] | None


class AsyncConsumer(Consumer):
    """Subclass this and implement ``async def handle`` (or ``async def handle_batch``).

    Everything else is :class:`~mqdedup.consumers.base.Consumer`'s: class attributes,
    promises, retry policy, failure isolation, dead letters, stored results. The
    handler's ``ctx.session`` is a guarded ``AsyncSession`` in the message's
    transaction and ``ctx.outbox`` an awaitable outbox writer in it. The hooks
    ``on_duplicate`` and ``after_commit`` are coroutines too.
    """

    asynchronous: ClassVar[bool] = True

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:  # type: ignore[override]
        """Apply one new message's effects through ``ctx.session`` / ``ctx.outbox``.

        Return a JSON-serialisable result to store it with the claim. Raise to fail the
        message: it is retried, then dead-lettered;
        :class:`~mqdedup.errors.MessageError` dead-letters at once.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    async def handle_batch(  # type: ignore[override]
        self, messages: Sequence[Message], ctx: AsyncBatchContext
    ) -> Mapping[str, Any] | None:
        """Optional bulk handler for all new messages of a batch; see
        :meth:`Consumer.handle_batch <mqdedup.consumers.base.Consumer.handle_batch>`."""
        raise NotImplementedError

    async def on_duplicate(self, message: Message, stored_result: Any) -> None:  # type: ignore[override]
        """Called for each duplicate with the first delivery's stored result (or None)."""

    async def after_commit(self, messages: Sequence[Message]) -> None:  # type: ignore[override]
        """Called after the transaction committed and before the broker is settled."""

    # -- running -------------------------------------------------------------------------

    async def run_async(
        self,
        database: Database,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> Metrics:
        """Consume on the running event loop until ``stop`` is requested (or cancelled).

        ``database``: an ``AsyncEngine`` (recommended: psycopg 3 async, aiosqlite), or
        a synchronous engine / session factory (its driver then blocks the loop during
        statements). The transport is built inside the bridge (an async transport may
        await its client's start). Cancelling the task running this is a graceful stop:
        the batch in flight is finished and settled, the transport closed, then
        ``CancelledError`` propagates; a second cancel stops at once.
        """
        stop = stop or StopToken()
        metrics = metrics if metrics is not None else Metrics()
        return await run_stoppable(stop, Consumer.run, self, database, stop=stop, metrics=metrics)

    def run(
        self,
        database: Database,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> Metrics:
        """Consume until ``stop`` is requested, on an event loop of its own.

        What ``mqdedup worker`` calls in each worker process: one event loop per
        process. A synchronous ``Engine`` is replaced by an ``AsyncEngine`` on the same
        URL (psycopg 3 async; SQLite through aiosqlite), disposed at the end. Inside
        the bridge (called by :meth:`run_async`) this is the base class's loop.
        """
        if in_bridge():
            return Consumer.run(self, database, stop=stop, metrics=metrics)
        return run_blocking(self._run_own_loop, database, stop, metrics)

    def _run_own_loop(
        self, database: Database, stop: StopToken | None, metrics: Metrics | None
    ) -> Metrics:
        owned = create_async_engine(database) if isinstance(database, Engine) else None
        try:
            return Consumer.run(self, owned or database, stop=stop, metrics=metrics)
        finally:
            if owned is not None:
                wait_for(owned.dispose())

    # -- introspection used by the processor ------------------------------------------------

    @property
    def has_batch_handler(self) -> bool:
        """True when the subclass implements :meth:`handle_batch`."""
        return type(self).handle_batch is not AsyncConsumer.handle_batch

    @property
    def has_single_handler(self) -> bool:
        """True when the subclass implements :meth:`handle`."""
        return type(self).handle is not AsyncConsumer.handle

    @property
    def wants_duplicate_results(self) -> bool:
        """True when :meth:`on_duplicate` is overridden (stored results are read then)."""
        return type(self).on_duplicate is not AsyncConsumer.on_duplicate


__all__ = ["AsyncBatchContext", "AsyncConsumer", "AsyncContext"]
