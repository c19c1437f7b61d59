"""What a handler gets besides its message: the guarded session and the outbox.

The processor builds a :class:`Context` (or :class:`BatchContext`) per handler call; the
session it carries cannot end the processor's transaction. An async consumer's handlers
get an :class:`AsyncContext` (:class:`AsyncBatchContext`): the same transaction as a
guarded ``AsyncSession`` and an awaitable outbox.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Connection, Table
from sqlalchemy.orm import Session

from mqdedup.consumers.staging import Stageable, capture, staged_writes
from mqdedup.consumers.steps import StepRunner
from mqdedup.dedup.steps import idempotency_key
from mqdedup.dedup.unique_keys import InsertOrGet, async_insert_or_get, insert_or_get
from mqdedup.errors import ConfigurationError, MessageError
from mqdedup.message import Message
from mqdedup.outbox.async_writer import AsyncOutboxWriter
from mqdedup.outbox.writer import OutboxWriter

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from mqdedup.consumers.spec import ConsumerSpec


class HandlerEndedTransactionError(RuntimeError):
    """A handler called ``commit``, ``rollback``, ``close`` or ``begin`` on ``ctx.session``.

    The transaction belongs to the processor: it holds the message's claim and its
    batch-mates' work, and commits them together before the broker is settled. The call
    is refused (nothing is ended) and the message fails like any raising handler.
    """


class HandlerChangedConnectionError(RuntimeError):
    """A handler changed the connection's ``client_encoding`` (``SET client_encoding``).

    The claims, the stored results and the next messages of this worker share the
    connection and are encoded with it: the change is refused as the message's own
    failure (its transaction or savepoint rolls back, which undoes the ``SET``), so it is
    retried and dead-lettered like any failing handler.
    """


class InvalidResultError(MessageError):
    """A handler returned a result no database can store as JSON (NaN, infinity, a NUL
    character, a lone surrogate, a type JSON does not have); the message is
    dead-lettered at once with this reason."""


#: Session methods that would end (or replace) the processor's transaction.
GUARDED_SESSION_METHODS = ("commit", "rollback", "close", "begin", "reset", "invalidate")
#: Methods of the session's ``Connection`` that would end it (``invalidate`` is left to
#: SQLAlchemy, which calls it on a lost connection: that is an outage, not a refusal).
GUARDED_CONNECTION_METHODS = ("commit", "rollback", "close", "detach")


def _refusal(method: str, owner: str = "ctx.session") -> Any:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise HandlerEndedTransactionError(
            f"a handler must not end the transaction: {owner}.{method}() is not allowed "
            "(mqdedup commits the message's claim and effects together after the handler)"
        )

    refuse.__name__ = method
    return refuse


def _guarded_begin(session: Session) -> Any:
    refuse = _refusal("begin")

    def begin(nested: bool = False) -> Any:
        if nested:  # begin_nested(): a savepoint inside the transaction is fine
            return Session.begin(session, nested=True)
        return refuse()

    return begin


_REFUSALS: dict[str, Any] = {method: _refusal(method) for method in GUARDED_SESSION_METHODS}
_CONNECTION_REFUSALS: dict[str, Any] = {
    method: _refusal(method, "ctx.session.connection()") for method in GUARDED_CONNECTION_METHODS
}
_REFUSALS_KEY = "mqdedup.refusals"
_GUARDED_CONNECTION_KEY = "mqdedup.guarded_connection"


def guard_session(session: Session, connection: Connection | None = None) -> None:
    """Make ``session``'s transaction-ending methods raise HandlerEndedTransactionError,
    and those of ``connection`` (the session's connection in this transaction) too.

    Instance attributes shadow the methods, so ``ctx.session`` stays a real ``Session``
    and ``ctx.session.connection()`` a real ``Connection`` (``ctx.outbox``, ORM calls,
    ``exec_driver_sql`` and savepoints with ``begin_nested()`` keep working); the guard
    costs a few dictionary updates per transaction. What no method covers (a ``COMMIT``
    statement, DDL that commits implicitly, the transaction objects' own ``commit()``) is
    found afterwards by :class:`mqdedup.db.transaction_state.TransactionWatch`.
    """
    refusals = session.info.get(_REFUSALS_KEY)
    if refusals is None:  # built once per session (a lease reuses it for a batch)
        refusals = {**_REFUSALS, "begin": _guarded_begin(session)}
        session.info[_REFUSALS_KEY] = refusals
    session.__dict__.update(refusals)
    if connection is not None:
        connection.__dict__.update(_CONNECTION_REFUSALS)
        session.info[_GUARDED_CONNECTION_KEY] = connection


def unguard_session(session: Session) -> None:
    """Undo :func:`guard_session` (the processor is about to end the transaction)."""
    namespace = session.__dict__
    for method in GUARDED_SESSION_METHODS:
        namespace.pop(method, None)
    connection = session.info.pop(_GUARDED_CONNECTION_KEY, None)
    if connection is not None:
        connection_namespace = connection.__dict__
        for method in GUARDED_CONNECTION_METHODS:
            connection_namespace.pop(method, None)


class NoTransactionError(ConfigurationError):
    """A handler used ``ctx.session`` or ``ctx.outbox`` of a consumer whose claims live
    outside the database (``dedup = RedisDedup(...)``): there is no transaction."""


class HandlerContext:
    """What the sync and async contexts share: the message, its consumer, a logger, and
    the transaction's ``Session`` (None for a claim store without a transaction)."""

    def __init__(self, session: Session | None, consumer: ConsumerSpec, message: Message) -> None:
        self._session = session
        self.consumer = consumer
        self.message = message

    def _transaction(self, what: str) -> Session:
        """The transaction's session, or :class:`NoTransactionError` naming ``what``."""
        if self._session is None:
            raise NoTransactionError(
                f"{what} is not available: {type(self.consumer).__name__} keeps its claims "
                f"in {self.consumer.dedup.describe()}, so its handler runs in no database "
                "transaction (use the default SQL dedup to write to a database)"
            )
        return self._session

    @cached_property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger for the handler that adds the message id and consumer name."""
        return logging.LoggerAdapter(
            logging.getLogger(f"mqdedup.handler.{self.consumer.consumer_name}"),
            {"message_id": self.message.id, "consumer": self.consumer.consumer_name},
        )

    @property
    def consumer_name(self) -> str:
        """The dedup scope this message is claimed in."""
        return self.consumer.consumer_name

    def idempotency_key(self, name: str, message: Message | None = None) -> str:
        """The key of the external call ``name`` for this message (32 hex characters).

        The same for this consumer, message id and name on every redelivery, replay and
        rerun; different per consumer and per name. Pass it to the third party so that
        it deduplicates the call: ``headers={"Idempotency-Key": key}``, or as the
        merchant order number of a payment API. ``handle_batch`` passes the message.
        See :mod:`mqdedup.dedup.steps`.
        """
        chosen = self._message_for(message, "ctx.idempotency_key")
        return idempotency_key(self.consumer.consumer_name, self._id_of(chosen), name)

    def _id_of(self, message: Message) -> str:
        return message.id if message.id is not None else self.consumer.message_id(message)

    def _message_for(self, message: Message | None, what: str) -> Message:
        return self.message if message is None else _checked_message(message, what)

    def _steps(self, message: Message | None, what: str) -> StepRunner:
        """The step runner of ``message`` (one per message and handler call)."""
        message_id = self._id_of(self._message_for(message, what))
        runners: dict[str, StepRunner] = self.__dict__.setdefault("_step_runners", {})
        runner = runners.get(message_id)
        if runner is None:
            runner = runners[message_id] = StepRunner(
                self._transaction(what),
                self.consumer.consumer_name,
                message_id,
                self.consumer.table_prefix,
            )
        return runner


class Context(HandlerContext):
    """What a handler gets besides the message: the transaction's session and outbox.

    ``session`` is the processor's transaction, guarded: ``commit()``, ``rollback()``,
    ``close()`` or ``begin()`` raise :class:`HandlerEndedTransactionError` (use
    ``begin_nested()`` for a savepoint of your own). A consumer whose claim store has
    no transaction (``dedup = RedisDedup(...)``) has neither: using them raises
    :class:`NoTransactionError` saying why.
    """

    @property
    def session(self) -> Session:
        """The transaction's (guarded) session."""
        return self._transaction("ctx.session")

    def stage(self, target: Stageable, row: Mapping[str, Any]) -> None:
        """Write ``row`` set-based at the batch end instead of now (the explicit fast path).

        ``target`` is a ``Table`` (the row is INSERTed) or an ``insert()`` / ``update()``
        / ``delete()`` statement whose values come from bind parameters (``row`` holds
        them). The row is copied now: changing the dict afterwards changes nothing.
        After the batch's last handler, the rows of one statement and one set of keys
        are written together (one executemany, or one ``unnest`` insert on PostgreSQL),
        in the transaction, before the commit: statements in the order of their first
        use, rows in staging order. The handler does not see its staged rows. A staged
        row that fails fails only its own message. See :mod:`mqdedup.consumers.staging`.
        """
        session = self.session
        staged = staged_writes(session)
        if staged is None:  # a session outside the processor's transactions: write now
            statement = target.insert() if isinstance(target, Table) else target
            session.execute(statement, capture(target, row))
            return
        staged.add(target, row)

    @cached_property
    def outbox(self) -> OutboxWriter:
        """Add outgoing messages to the outbox, in this transaction."""
        return OutboxWriter(
            self._transaction("ctx.outbox"),
            consumer_name=self.consumer.consumer_name,
            causation_id=self.message.id,
            prefix=self.consumer.table_prefix,
            message=self.message,
        )

    def step(self, name: str, fn: Callable[[str], Any], message: Message | None = None) -> Any:
        """Call ``fn(key)`` at most once per message and ``name`` as far as the database
        knows, and return its result (recorded as JSON; a rerun gets the record).

        ``key`` is :meth:`idempotency_key` of ``name``: pass it to the third party, which
        covers the one window the record cannot (a crash after the call, before its
        record committed). The record is written in a short transaction of its own, so
        it survives a rollback of the message's. See :mod:`mqdedup.consumers.steps`.
        ``handle_batch`` passes the message.
        """
        return self._steps(message, "ctx.step").run(name, fn)

    def insert_or_get(
        self, target: Any, row: Mapping[str, Any], *, key: str | Sequence[str]
    ) -> InsertOrGet:
        """Insert ``row`` into ``target`` (a ``Table`` or mapped class), or get the row
        stored under the same ``key`` (the columns of a unique key), in this transaction.

        Returns :class:`~mqdedup.dedup.unique_keys.InsertOrGet`: ``row`` (the stored
        row) and ``inserted`` (True: this call inserted it). No statement fails on the
        key, so the transaction and the batch-mates' writes are never undone, and no
        savepoint is needed; concurrent workers inserting the same key create one row.
        See :mod:`mqdedup.dedup.unique_keys`.
        """
        return insert_or_get(self.session, target, row, key=key)


def _batch_message(messages: Sequence[Message], message: Message | None, what: str) -> Message:
    if message is None:
        if len(messages) > 1:
            raise TypeError(
                f"{what} in handle_batch needs the message: {what}(name, ..., message=m)"
            )
        return messages[0]
    return _checked_message(message, what)


def _checked_message(message: object, what: str) -> Message:
    """``message`` if it is a Message, else a TypeError naming the argument."""
    if not isinstance(message, Message):
        raise TypeError(
            f"{what}(name, ..., message=m): message must be a mqdedup Message, "
            f"got {type(message).__name__}: {message!r:.80}"
        )
    return message


class BatchContext(Context):
    """Context of :meth:`Consumer.handle_batch`; ``message`` is the batch's first one."""

    def __init__(
        self, session: Session | None, consumer: ConsumerSpec, messages: Sequence[Message]
    ) -> None:
        super().__init__(session, consumer, messages[0])
        self.messages = messages

    def _message_for(self, message: Message | None, what: str) -> Message:
        return _batch_message(self.messages, message, what)


# -- async consumers ---------------------------------------------------------------------
#
# The pipeline runs the same transaction as for synchronous consumers (a ``Session`` on
# the ``AsyncEngine``'s ``sync_engine``, inside the bridge); ``ctx.session`` is an
# ``AsyncSession`` proxying that very session, so the guard applies through the proxy.

_PROXY_KEY = "mqdedup.async_session"


def async_proxy(session: Session) -> AsyncSession:
    """The ``AsyncSession`` proxying the pipeline's ``session`` (built once per session).

    The proxy is kept in ``session.info``: SQLAlchemy only holds it weakly.
    """
    proxy = session.info.get(_PROXY_KEY)
    if proxy is None:
        from sqlalchemy.ext.asyncio import AsyncSession  # the asyncio extra (greenlet)

        # The "session class" may be any callable: here one returning the existing session.
        proxy = AsyncSession(sync_session_class=lambda **_: session)  # type: ignore[arg-type]
        session.info[_PROXY_KEY] = proxy
    return cast("AsyncSession", proxy)


class AsyncContext(HandlerContext):
    """The context of an async consumer's ``handle`` (``AsyncBatchContext``: ``handle_batch``).

    ``session`` is the message's transaction as a guarded ``AsyncSession``; ``outbox``
    an :class:`~mqdedup.outbox.async_writer.AsyncOutboxWriter` in that transaction
    (``await ctx.outbox.publish(...)``). A consumer whose claim store has no
    transaction (``dedup = RedisDedup(...)``) has neither: using them raises
    :class:`~mqdedup.consumers.context.NoTransactionError` saying why.
    """

    @cached_property
    def session(self) -> AsyncSession:
        """The transaction's (guarded) ``AsyncSession``."""
        return async_proxy(self._transaction("ctx.session"))

    @cached_property
    def outbox(self) -> AsyncOutboxWriter:
        """Add outgoing messages to the outbox, in this transaction (awaitable)."""
        self._transaction("ctx.outbox")
        return AsyncOutboxWriter(
            self.session,
            consumer_name=self.consumer.consumer_name,
            causation_id=self.message.id,
            prefix=self.consumer.table_prefix,
            message=self.message,
        )

    async def step(
        self,
        name: str,
        fn: Callable[[str], Awaitable[Any] | Any],
        message: Message | None = None,
    ) -> Any:
        """``await ctx.step(name, fn)``: :meth:`Context.step` for async consumers;
        ``fn(key)`` may be a coroutine function."""
        runner = self._steps(message, "ctx.step")
        return await runner.run_async(self.session, name, fn)

    async def insert_or_get(
        self, target: Any, row: Mapping[str, Any], *, key: str | Sequence[str]
    ) -> InsertOrGet:
        """``await ctx.insert_or_get(target, row, key=[...])``: :meth:`Context.insert_or_get`
        for async consumers."""
        return await async_insert_or_get(self.session, target, row, key=key)


class AsyncBatchContext(AsyncContext):
    """Context of ``AsyncConsumer.handle_batch``; ``message`` is the batch's first one."""

    def __init__(
        self, session: Session | None, consumer: ConsumerSpec, messages: Sequence[Message]
    ) -> None:
        super().__init__(session, consumer, messages[0])
        self.messages = messages

    def _message_for(self, message: Message | None, what: str) -> Message:
        return _batch_message(self.messages, message, what)
