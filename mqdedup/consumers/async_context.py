"""What an async handler gets besides its message: a guarded ``AsyncSession`` and outbox.

The pipeline runs the same transaction as for synchronous consumers (a ``Session`` on
the ``AsyncEngine``'s ``sync_engine``, inside the bridge); ``ctx.session`` is an
``AsyncSession`` proxying that very session, so the handler's ``await
ctx.session.execute(...)`` writes in the message's transaction. The guard of the
synchronous session applies through the proxy: ``await ctx.session.commit()``,
``rollback()``, ``close()`` or ``begin()`` raise
:class:`~mqdedup.consumers.context.HandlerEndedTransactionError` (``begin_nested()``
for a savepoint of your own is fine).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from mqdedup.consumers.context import BatchContext, Context, NoTransactionError
from mqdedup.outbox.async_writer import AsyncOutboxWriter

if TYPE_CHECKING:
    from mqdedup.consumers.base import Consumer
    from mqdedup.message import Message

_PROXY_KEY = "mqdedup.async_session"


def async_proxy(session: Session) -> AsyncSession:
    """The ``AsyncSession`` proxying the pipeline's ``session`` (built once per session).

    The proxy is kept in ``session.info``: SQLAlchemy only holds it weakly.
    """
    proxy = session.info.get(_PROXY_KEY)
    if proxy is None:
        # The "session class" may be any callable: here one returning the existing session.
        proxy = AsyncSession(sync_session_class=lambda **_: session)  # type: ignore[arg-type]
        session.info[_PROXY_KEY] = proxy
    return cast(AsyncSession, proxy)


class AsyncContext:
    """The context of an async consumer's ``handle`` (``AsyncBatchContext``: ``handle_batch``).

    ``session`` is the message's transaction as a guarded ``AsyncSession``; ``outbox``
    an :class:`~mqdedup.outbox.async_writer.AsyncOutboxWriter` in that transaction
    (``await ctx.outbox.publish(...)``). A consumer whose claim store has no
    transaction (``dedup = RedisDedup(...)``) has neither: using them raises
    :class:`~mqdedup.consumers.context.NoTransactionError` saying why.
    """

    def __init__(self, session: Session | None, consumer: Consumer, message: Message) -> None:
        self._sync_session = session
        self.consumer = consumer
        self.message = message

    @cached_property
    def session(self) -> AsyncSession:
        """The transaction's (guarded) ``AsyncSession``."""
        if self._sync_session is None:
            raise NoTransactionError(self._no_transaction("ctx.session"))
        return async_proxy(self._sync_session)

    @cached_property
    def outbox(self) -> AsyncOutboxWriter:
        """Add outgoing messages to the outbox, in this transaction (awaitable)."""
        if self._sync_session is None:
            raise NoTransactionError(self._no_transaction("ctx.outbox"))
        return AsyncOutboxWriter(
            self.session,
            consumer_name=self.consumer.consumer_name,
            causation_id=self.message.id,
            prefix=self.consumer.table_prefix,
            message=self.message,
        )

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

    def _no_transaction(self, what: str) -> str:
        return (
            f"{what} is not available: {type(self.consumer).__name__} keeps its claims in "
            f"{self.consumer.dedup.describe()}, so its handler runs in no database "
            "transaction (use the default SQL dedup to write to a database)"
        )


class AsyncBatchContext(AsyncContext):
    """Context of ``AsyncConsumer.handle_batch``; ``message`` is the batch's first one."""

    def __init__(
        self, session: Session | None, consumer: Consumer, messages: Sequence[Message]
    ) -> None:
        super().__init__(session, consumer, messages[0])
        self.messages = messages


def context_types(consumer: Consumer) -> tuple[type[Any], type[Any]]:
    """The (per-message, batch) context classes the handlers of ``consumer`` get."""
    if consumer.asynchronous:
        return AsyncContext, AsyncBatchContext
    return Context, BatchContext
