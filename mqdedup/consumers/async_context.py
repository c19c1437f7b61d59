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

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, cast

from sqlalchemy.orm import Session

from mqdedup.consumers.context import HandlerContext
from mqdedup.outbox.async_writer import AsyncOutboxWriter

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from mqdedup.consumers.base import Consumer
    from mqdedup.message import Message

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


class AsyncBatchContext(AsyncContext):
    """Context of ``AsyncConsumer.handle_batch``; ``message`` is the batch's first one."""

    def __init__(
        self, session: Session | None, consumer: Consumer, messages: Sequence[Message]
    ) -> None:
        super().__init__(session, consumer, messages[0])
        self.messages = messages
