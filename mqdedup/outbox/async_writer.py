"""The outbox writer for an ``AsyncSession``: the same rows, awaited.

Inside an async consumer use ``ctx.outbox`` (an :class:`AsyncOutboxWriter`)::

    async def handle(self, message, ctx):
        await ctx.session.execute(insert(orders).values(...))
        await ctx.outbox.publish({"order": 7}, topic="order-events", key="7")

Anywhere else (a FastAPI endpoint, a script) wrap any SQLAlchemy ``AsyncSession``::

    async with AsyncSession(engine) as session, session.begin():
        session.add(order)
        await AsyncOutboxWriter(session).publish({"order": 1}, topic="order-events")

The rows are written by :class:`~mqdedup.outbox.writer.OutboxWriter` on the
``AsyncSession``'s own synchronous session (``session.run_sync``), so ids, headers,
validation and the commit notification are exactly those of the synchronous writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.message import Message
from mqdedup.outbox.writer import HeaderInput, OutboxWriter, OutgoingMessage


class AsyncOutboxWriter:
    """Adds outgoing messages to ``<prefix>outbox`` in the caller's ``AsyncSession``.

    The arguments are :class:`~mqdedup.outbox.writer.OutboxWriter`'s; the rows commit
    or roll back with the session's transaction and the relay publishes them after
    commit. One writer belongs to one handler run (or one request).
    """

    def __init__(
        self,
        session: AsyncSession,
        *,
        consumer_name: str | None = None,
        causation_id: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        message: Message | None = None,
    ) -> None:
        if not isinstance(session, AsyncSession):
            raise TypeError(
                f"AsyncOutboxWriter needs an AsyncSession, not {type(session).__name__}; "
                "for a synchronous Session use OutboxWriter(session).publish(...)"
            )
        self.session = session
        self.writer = OutboxWriter(
            session.sync_session,
            consumer_name=consumer_name,
            causation_id=causation_id,
            prefix=prefix,
            message=message,
        )

    async def publish(
        self,
        payload: Any,
        *,
        topic: str | None = None,
        exchange: str | None = None,
        routing_key: str | None = None,
        key: bytes | str | None = None,
        headers: Mapping[str, HeaderInput] | None = None,
        properties: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        delay: float | timedelta | None = None,
        cause: Message | str | None = None,
        traceparent: str | None = None,
        broker: str | None = None,
    ) -> str:
        """Write one outgoing message (see :class:`~mqdedup.outbox.writer.OutgoingMessage`);
        return its message id."""
        message = OutgoingMessage(
            payload=payload,
            topic=topic,
            exchange=exchange,
            routing_key=routing_key,
            key=key,
            headers=headers,
            properties=properties,
            message_id=message_id,
            delay=delay,
            cause=cause,
            traceparent=traceparent,
            broker=broker,
        )
        return (await self.publish_many([message]))[0]

    async def publish_many(self, messages: Iterable[OutgoingMessage]) -> list[str]:
        """Write several outgoing messages with one statement; return their message ids."""
        rows = list(messages)  # built here: a generator must not run in another greenlet

        def write(_session: Session) -> list[str]:
            return self.writer.publish_many(rows)

        return await self.session.run_sync(write)
