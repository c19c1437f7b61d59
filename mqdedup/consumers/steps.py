"""``ctx.step(name, fn)``: an external call made once per message and name, as far as the
database can know.

A step runs in three short transactions of its own on the consumer's engine (a
connection of its own, not the message's transaction):

1. **start**: if the step is recorded as done for this consumer, message id and name,
   its recorded result is returned and ``fn`` is not called. Otherwise the step is
   marked ``started`` (its attempts counted) and that is committed.
2. **call**: ``fn(key)`` runs with the step's idempotency key
   (:func:`mqdedup.dedup.steps.idempotency_key`), outside any transaction.
3. **record**: the result, as JSON, is committed as ``done`` before the step returns
   it (the returned value is the JSON round trip, the same a rerun reads back).

Because the record is not part of the message's transaction, it survives what that
transaction does not: a crash before the commit, a batch-mate's failure that reruns
the batch, a later handler error and its retry. The rerun of the handler gets the
recorded result without calling again.

**The window.** Between the moment the third party acts on the call and the moment the
record commits (the call's response on the wire, the record's transaction), a crash
or a lost database connection leaves the step ``started`` without a result. The rerun
then calls again, **with the same key**: that is the one case the third party's own
deduplication on the key must cover (an ``Idempotency-Key`` header, a merchant order
number). A call that raises records nothing: the message fails as usual and its retry
calls again with the same key.

SQLite allows one writer per file and the message's transaction holds it while the
handler runs, so there the record is written in the message's transaction instead:
it is lost with a rollback of that transaction (the message's, or its whole batch's
when the batch reruns), and the rerun calls again with the same key (covered by the
third party's deduplication only).

A consumer whose claims live in Redis (``dedup = RedisDedup(...)``) has no database:
``ctx.step`` raises :class:`~mqdedup.consumers.context.NoTransactionError` there.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from mqdedup.dedup.steps import Recorded, StepStore, as_json, check_step_name, idempotency_key

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepRunner:
    """Runs the steps of one message (built by the context, per handler call)."""

    def __init__(self, session: Session, consumer_name: str, message_id: str, prefix: str) -> None:
        self.session = session
        self.consumer = consumer_name
        self.message_id = message_id
        self.store = StepStore(prefix)
        bind = session.get_bind()
        self.engine: Engine = bind if isinstance(bind, Engine) else bind.engine
        #: SQLite: one writer per file, held by the message's transaction.
        self.in_transaction = self.engine.dialect.name == "sqlite"

    def key(self, name: str) -> str:
        """The step's idempotency key."""
        return idempotency_key(self.consumer, self.message_id, name)

    def _start(self, connection: Connection, name: str) -> Recorded | None:
        return self.store.start(connection, self.consumer, self.message_id, name)

    def _record(self, connection: Connection, name: str, result: Any) -> None:
        self.store.record(connection, self.consumer, self.message_id, name, result)

    def run(self, name: str, fn: Callable[[str], Any]) -> Any:
        """Start, call ``fn(key)``, record; or the recorded result (see the module)."""
        check_step_name(name)
        key = self.key(name)
        recorded = self._in_own_transaction(lambda connection: self._start(connection, name))
        if recorded is not None:
            log.info("step already done", extra=self._extra(name))
            return recorded.result
        result = as_json(name, fn(key))
        self._in_own_transaction(lambda connection: self._record(connection, name, result))
        log.debug("step recorded", extra=self._extra(name))
        return result

    async def run_async(
        self, proxy: AsyncSession, name: str, fn: Callable[[str], Awaitable[Any] | Any]
    ) -> Any:
        """:meth:`run` for an async consumer: ``fn(key)`` may return an awaitable."""
        check_step_name(name)
        key = self.key(name)
        recorded = await self._in_own_transaction_async(
            proxy, lambda connection: self._start(connection, name)
        )
        if recorded is not None:
            log.info("step already done", extra=self._extra(name))
            return recorded.result
        value = fn(key)
        if inspect.isawaitable(value):
            value = await value
        result = as_json(name, value)
        await self._in_own_transaction_async(
            proxy, lambda connection: self._record(connection, name, result)
        )
        log.debug("step recorded", extra=self._extra(name))
        return result

    def _in_own_transaction(self, work: Callable[[Connection], T]) -> T:
        if self.in_transaction:
            return work(self.session.connection())
        with self.engine.begin() as connection:
            return work(connection)

    async def _in_own_transaction_async(
        self, proxy: AsyncSession, work: Callable[[Connection], T]
    ) -> T:
        if self.in_transaction:
            return await proxy.run_sync(lambda session: work(session.connection()))
        from sqlalchemy.ext.asyncio import AsyncEngine  # the asyncio extra (greenlet)

        async with AsyncEngine(self.engine).begin() as connection:
            return await connection.run_sync(work)

    def _extra(self, name: str) -> dict[str, str]:
        return {"consumer": self.consumer, "message_id": self.message_id, "step": name}
