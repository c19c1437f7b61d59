"""``ctx.step(name, fn)``: an external call made once per message and name, as far as the
database can know.

A step runs in three short transactions of its own on the consumer's engine (a
connection of its own, not the message's transaction):

1. **start**: if the step is recorded as done for this consumer, message id and name,
   its recorded result is returned and ``fn`` is not called. Otherwise the step is
   marked ``started`` (its attempts counted) and that is committed.
2. **call**: ``fn(key)`` runs with the step's idempotency key
   (:func:`mqdedup.dedup.steps.idempotency_key`), outside any transaction.
3. **record**: the result's JSON text is committed as ``done`` before the step returns
   it; the returned value is that text read back, exactly what a rerun reads back
   (:func:`mqdedup.dedup.steps.serialize`).

The name, ``fn`` and the message are checked before anything is read or called. A
result that cannot be recorded (not JSON data, nested deeper than 100 levels, refused
by the database) is recorded as ``unstorable`` and raises
:class:`~mqdedup.dedup.steps.StepResultError`, a message error: the message is
dead-lettered at once after one call, and a rerun raises again without calling.

Because the record is not part of the message's transaction, it survives what that
transaction does not: a crash before the commit, a batch-mate's failure that reruns
the batch, a later handler error and its retry. The rerun of the handler gets the
recorded result without calling again. An engine whose ``begin()`` is not a
transaction of its own (Django's: a savepoint of the thread's atomic block) names the
engine steps record on with :func:`record_steps_with`.

**The window.** Between the moment the third party acts on the call and the moment the
record commits (the call's response on the wire, the record's transaction), a crash
or a lost database connection leaves the step ``started`` without a result. The rerun
then calls again, **with the same key**: that is the one case the third party's own
deduplication on the key must cover (an ``Idempotency-Key`` header, a merchant order
number). A call that raises records nothing: the message fails as usual and its retry
calls again with the same key.

**Stopping.** A step's start may wait for a connection (the engine's pool, a pooler's
queue) longer than the worker's shutdown timeout. A stop signal arriving during that
wait abandons it: nothing was called, the message's transaction rolls back and its
batch goes back to the broker unsettled, to be redelivered (see
:func:`mqdedup.stopping.abandoned_on_stop`; on an ``AsyncEngine``, whose wait is in the
event loop, :func:`mqdedup.stopping.abandon_on_stop`).

SQLite allows one writer per file and the message's transaction holds it while the
handler runs, so there the record is written in the message's transaction instead (in
a savepoint of it): it is lost with a rollback of that transaction (the message's, or
its whole batch's when the batch reruns), and the rerun calls again with the same key
(covered by the third party's deduplication only).

A consumer whose claims live in Redis (``dedup = RedisDedup(...)``) has no database:
``ctx.step`` raises :class:`~mqdedup.consumers.context.NoTransactionError` there.
"""

from __future__ import annotations

import inspect
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from mqdedup.bridge import in_bridge, wait_for
from mqdedup.db.dialects import is_transient
from mqdedup.dedup.steps import (
    Recorded,
    StepResultError,
    StepStore,
    check_step_function,
    check_step_name,
    idempotency_key,
    serialize,
)
from mqdedup.stopping import abandon_on_stop, abandoned_on_stop

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Where a step records, for engines whose connections are not their own (Django's
#: engine hands out the thread's one Django connection): see :func:`record_steps_with`.
_RECORDERS: weakref.WeakKeyDictionary[Engine, Callable[[Connection], Engine | None]] = (
    weakref.WeakKeyDictionary()
)


def record_steps_with(engine: Engine, choose: Callable[[Connection], Engine | None]) -> None:
    """Steps of messages handled on ``engine`` record on ``choose(connection)`` instead.

    ``connection`` is the message's; ``choose`` returns an engine whose transactions are
    independent of it, or None to record in the message's transaction (as on SQLite).
    For an engine whose ``begin()`` would only open a savepoint of the message's
    transaction (:mod:`mqdedup.django`), where a record would roll back with it.
    """
    _RECORDERS[engine] = choose


class StepRunner:
    """Runs the steps of one message (built by the context, per handler call)."""

    def __init__(self, session: Session, consumer_name: str, message_id: str, prefix: str) -> None:
        self.session = session
        self.consumer = consumer_name
        self.message_id = message_id
        self.store = StepStore(prefix)
        bind = session.get_bind()
        engine: Engine = bind if isinstance(bind, Engine) else bind.engine
        #: The engine of the steps' own transactions (None: the message's transaction;
        #: SQLite: one writer per file, held by the message's transaction).
        self.engine: Engine | None = None
        if engine.dialect.name != "sqlite":
            choose = _RECORDERS.get(engine)
            self.engine = engine if choose is None else choose(session.connection())

    def key(self, name: str) -> str:
        """The step's idempotency key."""
        return idempotency_key(self.consumer, self.message_id, name)

    def _start(self, connection: Connection, name: str) -> Recorded | None:
        return self.store.start(connection, self.consumer, self.message_id, name)

    def run(self, name: str, fn: Callable[[str], Any]) -> Any:
        """Start, call ``fn(key)``, record; or the recorded result (see the module)."""
        check_step_name(name)
        check_step_function(fn)
        key = self.key(name)
        recorded = self._starting(name)
        if recorded is not None:
            log.info("step already done", extra=self._extra(name))
            return recorded.result
        return self._finish(name, fn(key))

    def _starting(self, name: str) -> Recorded | None:
        """The start, on a connection of its own: the one wait of a step that may
        outlast a shutdown (the pool's ``pool_timeout``, a pooler's
        ``query_wait_timeout``). A stop signal during it abandons it
        (:class:`~mqdedup.stopping.StopWhileWaiting`): nothing was called yet, the
        message goes back unsettled. Inside the asyncio bridge (a consumer on an
        ``AsyncEngine``) the wait is in the event loop, which a signal must not
        interrupt: the start is awaited under
        :func:`~mqdedup.stopping.abandon_on_stop` instead."""
        if self.engine is not None and in_bridge() and self.engine.dialect.is_async:
            start = self._own_transaction_async(lambda connection: self._start(connection, name))
            return wait_for(abandon_on_stop(start, f"step {name!r} waited for a connection"))
        if self.engine is None or in_bridge():
            return self._in_own_transaction(lambda connection: self._start(connection, name))
        with abandoned_on_stop(f"step {name!r} waited for a connection"):
            return self._in_own_transaction(lambda connection: self._start(connection, name))

    async def run_async(
        self, proxy: AsyncSession, name: str, fn: Callable[[str], Awaitable[Any] | Any]
    ) -> Any:
        """:meth:`run` for an async consumer: ``fn(key)`` may return an awaitable."""
        check_step_name(name)
        check_step_function(fn)
        key = self.key(name)
        recorded = await self._starting_async(proxy, name)
        if recorded is not None:
            log.info("step already done", extra=self._extra(name))
            return recorded.result
        value = fn(key)
        if inspect.isawaitable(value):
            value = await value
        try:
            text = serialize(name, value)
            try:
                await self._in_own_transaction_async(proxy, self._record(name, text))
            except DBAPIError as error:
                if is_transient(error):
                    raise  # an outage: the rerun calls again with the same key
                raise _refused(name, error) from error
        except StepResultError as error:
            await self._in_own_transaction_async(proxy, self._unstorable(name, error))
            raise
        log.debug("step recorded", extra=self._extra(name))
        return json.loads(text)

    async def _starting_async(self, proxy: AsyncSession, name: str) -> Recorded | None:
        """:meth:`_starting` on an ``AsyncEngine``: the start's wait happens in the event
        loop, which a signal does not interrupt; a stop requested during it cancels it
        (:func:`~mqdedup.stopping.abandon_on_stop`). Nothing was called yet."""
        start = self._in_own_transaction_async(
            proxy, lambda connection: self._start(connection, name)
        )
        if self.engine is None or not self.engine.dialect.is_async:
            return await start
        return await abandon_on_stop(start, f"step {name!r} waited for a connection")

    def _finish(self, name: str, value: Any) -> Any:
        """Record the call's ``value``; return it as the record holds it (the value a
        rerun reads back). A value that cannot be recorded (or that the database
        refuses) is recorded as such and raises StepResultError: no rerun calls again."""
        try:
            text = serialize(name, value)
            try:
                self._in_own_transaction(self._record(name, text))
            except DBAPIError as error:
                if is_transient(error):
                    raise  # an outage: the rerun calls again with the same key
                raise _refused(name, error) from error
        except StepResultError as error:
            self._in_own_transaction(self._unstorable(name, error))
            raise
        log.debug("step recorded", extra=self._extra(name))
        return json.loads(text)

    def _record(self, name: str, text: str) -> Callable[[Connection], None]:
        def record(connection: Connection) -> None:
            self.store.record(connection, self.consumer, self.message_id, name, text)

        return record

    def _unstorable(self, name: str, error: StepResultError) -> Callable[[Connection], None]:
        log.warning(
            "step result not recorded; the step is not called again",
            extra={**self._extra(name), "reason": error.reason},
        )

        def record(connection: Connection) -> None:
            self.store.record_unstorable(
                connection, self.consumer, self.message_id, name, error.reason
            )

        return record

    def _in_own_transaction(self, work: Callable[[Connection], T]) -> T:
        if self.engine is None:
            return _in_savepoint(self.session, work)
        with self.engine.begin() as connection:
            return work(connection)

    async def _in_own_transaction_async(
        self, proxy: AsyncSession, work: Callable[[Connection], T]
    ) -> T:
        if self.engine is None:
            return await proxy.run_sync(_in_savepoint, work)
        if not self.engine.dialect.is_async:  # a recorder's engine (record_steps_with)
            return self._in_own_transaction(work)
        return await self._own_transaction_async(work)

    async def _own_transaction_async(self, work: Callable[[Connection], T]) -> T:
        """``work`` in a transaction of its own on the (async) :attr:`engine`."""
        from sqlalchemy.ext.asyncio import AsyncEngine  # the asyncio extra (greenlet)

        assert self.engine is not None
        async with AsyncEngine(self.engine).begin() as connection:
            return await connection.run_sync(work)

    def _extra(self, name: str) -> dict[str, str]:
        return {"consumer": self.consumer, "message_id": self.message_id, "step": name}


def _in_savepoint(session: Session, work: Callable[[Connection], T]) -> T:
    """``work`` in a savepoint of the message's transaction (a refused statement leaves
    the transaction usable)."""
    with session.begin_nested():
        return work(session.connection())


def _refused(name: str, error: DBAPIError) -> StepResultError:
    """The database refused a step's record (not an outage): the value is the cause."""
    return StepResultError(
        f"step {name!r} returned a value the database refused to record "
        f"({type(error.orig).__name__}: {str(error.orig).strip()[:300]})"
    )
