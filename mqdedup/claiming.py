"""The claim as a library call: effectively-once for a consumer you already have.

A FastStream subscriber, a Celery task or a hand-written kafka-python loop keeps its own
loop, its own broker client and its own transaction. It calls :func:`claim` (or
:func:`async_claim`) as the first statement of that transaction; when the message was
new it does its writes, then commits, then acks::

    with Session(engine) as session, session.begin():
        claimed = claim(session, message_id, consumer="billing")
        if claimed.is_duplicate:
            answer = claimed.stored_result      # what the first run stored, or None
        else:
            session.add(Invoice(...))
            claimed.store_result({"invoice": 42})
    ack()                                       # after the commit, never before

The claim inserts ``(consumer, message_id)`` into ``<prefix>processed_messages``
(``INSERT … ON CONFLICT DO NOTHING RETURNING``) in the caller's transaction, so it
commits or rolls back with the business writes. A second copy of the message, later
or at the same moment in another process, finds the row (a concurrent copy waits on
the unique index until the first transaction ends) and is a *duplicate*: it carries
the result the first run stored. Roll back, and the claim is gone with the writes: the
redelivery runs again. The tables come from ``mqdedup db init`` (or
:func:`mqdedup.init_schema`).

What stays the caller's job: commit before the ack (a crash between them redelivers a
message whose claim committed: a duplicate, skipped), and keep the effects in that
transaction (an e-mail sent before a crash is sent again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from mqdedup.consumers.handling import ensure_json
from mqdedup.db.schema import DEFAULT_PREFIX, validate_prefix
from mqdedup.dedup.ids import MAX_ID_LENGTH, check_message_id
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError, MqdedupError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["AsyncClaim", "Claim", "ClaimError", "async_claim", "claim"]

_STORES: dict[str, DedupStore] = {}


class ClaimError(MqdedupError):
    """A claim was used in a way that cannot work (storing a duplicate's result)."""


def _store(prefix: str) -> DedupStore:
    store = _STORES.get(prefix)
    if store is None:
        store = _STORES[prefix] = DedupStore(validate_prefix(prefix))
    return store


def _check_consumer(consumer: object) -> str:
    if (
        not isinstance(consumer, str)
        or not consumer.strip()
        or len(consumer) > MAX_ID_LENGTH
        or "\x00" in consumer
    ):
        raise ConfigurationError(
            f"claim(): consumer must be a name of 1 to {MAX_ID_LENGTH} characters "
            f"without NUL, got {consumer!r}"
        )
    return consumer


@dataclass
class Claim:
    """The answer of :func:`claim` for one message.

    ``is_duplicate`` is True when the message was claimed before (a committed claim, or
    one committed by a concurrent transaction this claim waited for); then
    ``stored_result`` holds what the first run stored with :meth:`store_result` (None if
    it stored nothing) and the caller must skip the message's effects.
    """

    consumer: str
    message_id: str
    is_duplicate: bool
    stored_result: Any = None
    _session: Session | None = field(default=None, repr=False, compare=False)
    _prefix: str = field(default=DEFAULT_PREFIX, repr=False, compare=False)

    @property
    def is_new(self) -> bool:
        """True when this transaction holds the claim: run the message's effects."""
        return not self.is_duplicate

    def store_result(self, value: Any) -> None:
        """Store ``value`` (strict JSON) next to the claim, in the same transaction.

        A later duplicate of the message gets it as ``stored_result``. Raises
        :class:`ClaimError` on a duplicate (its result is stored already) and
        :class:`~mqdedup.InvalidResultError` for a value JSON cannot hold.
        """
        if self.is_duplicate or self._session is None:
            raise ClaimError(
                f"message {self.message_id!r} is a duplicate for consumer {self.consumer!r}: "
                "its result was stored by the first run (read claim.stored_result)"
            )
        ensure_json(value)
        if value is not None:
            store = _store(self._prefix)
            store.save_results(self._session, self.consumer, {self.message_id: value})


def claim(
    session_or_connection: Session | Connection,
    message_id: str,
    *,
    consumer: str,
    prefix: str = DEFAULT_PREFIX,
) -> Claim:
    """Claim ``message_id`` for ``consumer`` inside the caller's transaction.

    ``session_or_connection`` is a SQLAlchemy ``Session`` or ``Connection``; a
    transaction is begun if none is (SQLAlchemy's autobegin) and stays the caller's to
    commit or roll back. Call it first in the transaction, before the business writes.
    ``prefix`` is the table prefix given to ``mqdedup db init`` (default ``mqdedup_``).

    Raises :class:`~mqdedup.MissingMessageIdError` /
    :class:`~mqdedup.InvalidMessageIdError` for an id no database can store as a key
    (empty, NUL byte, over 255 characters) and :class:`~mqdedup.ConfigurationError` for
    an empty consumer name.
    """
    message_id = check_message_id(message_id, "message id given to claim()")
    consumer = _check_consumer(consumer)
    session = _session_of(session_or_connection)
    store = _store(prefix)
    if store.claim(session, consumer, [message_id]).new:
        return Claim(consumer, message_id, False, None, session, prefix)
    stored = store.results(session, consumer, [message_id]).get(message_id)
    return Claim(consumer, message_id, True, stored, None, prefix)


def _session_of(target: Session | Connection) -> Session:
    if isinstance(target, Session):
        return target
    if isinstance(target, Connection):
        if not target.in_transaction():
            target.begin()  # what the connection's autobegin does: the caller commits
        # Joins the connection's transaction (never commits it: only this module runs
        # statements through this Session, and it never calls commit or close).
        return Session(bind=target)
    raise ConfigurationError(
        "claim() needs a SQLAlchemy Session or Connection (AsyncSession: use async_claim()), "
        f"got {type(target).__name__}"
    )


@dataclass
class AsyncClaim:
    """The answer of :func:`async_claim`: :class:`Claim` with an awaitable
    :meth:`store_result`."""

    consumer: str
    message_id: str
    is_duplicate: bool
    stored_result: Any = None
    _target: AsyncSession | AsyncConnection | None = field(default=None, repr=False, compare=False)
    _prefix: str = field(default=DEFAULT_PREFIX, repr=False, compare=False)

    @property
    def is_new(self) -> bool:
        """True when this transaction holds the claim: run the message's effects."""
        return not self.is_duplicate

    async def store_result(self, value: Any) -> None:
        """Store ``value`` next to the claim, in the same transaction (see
        :meth:`Claim.store_result`)."""
        if self.is_duplicate or self._target is None:
            raise ClaimError(
                f"message {self.message_id!r} is a duplicate for consumer {self.consumer!r}: "
                "its result was stored by the first run (read claim.stored_result)"
            )
        ensure_json(value)
        if value is None:
            return
        consumer, message_id, store = self.consumer, self.message_id, _store(self._prefix)

        def save(target: Session | Connection) -> None:
            store.save_results(_session_of(target), consumer, {message_id: value})

        await self._target.run_sync(save)


async def async_claim(
    session_or_connection: AsyncSession | AsyncConnection,
    message_id: str,
    *,
    consumer: str,
    prefix: str = DEFAULT_PREFIX,
) -> AsyncClaim:
    """:func:`claim` for an ``AsyncSession`` or ``AsyncConnection`` (awaitable).

    ``claimed = await async_claim(session, message_id, consumer="billing")``; then
    ``await claimed.store_result(value)`` for a new message.
    """

    def run(target: Session | Connection) -> Claim:
        return claim(target, message_id, consumer=consumer, prefix=prefix)

    done = await session_or_connection.run_sync(run)
    return AsyncClaim(
        done.consumer,
        done.message_id,
        done.is_duplicate,
        done.stored_result,
        None if done.is_duplicate else session_or_connection,
        prefix,
    )
