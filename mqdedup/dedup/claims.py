"""The claim-store seam: where a consumer's claims live, and how a consumer chooses it.

The Processor (:mod:`mqdedup.consumers.processor`) drives every consumer the same way:
take message ids, claim them, run the handler for the new ones, store their results,
settle the broker. Only *where claims live* differs, and that is all a
:class:`ClaimStore` answers (after watermill's deduplicator middleware: dedup behind
a small repository interface):

* :class:`~mqdedup.dedup.store.DedupStore` (the default): the dedup table, in
  the handler's own database transaction. Claim, business writes, outbox rows and
  results commit together; a failing handler's claim is rolled back or forgotten in
  that transaction. ``transactional`` is True.
* :class:`~mqdedup.dedup.redis_claims.RedisClaimStore`: a Redis key per message id,
  leased while its handler runs, for handlers without a database write. There is no
  transaction: the completion (with the result) is written right after each handler,
  a failed handler's claim is released, a crashed worker's lease runs out.
  ``transactional`` is False.

The ack contract is the same for both: the Processor settles a delivery (ack, offset
commit, dead letter) only after its claim and result are durable in the store — the
SQL commit, or the Redis completion — or after it was found to be a duplicate.

A consumer chooses its store with the ``dedup`` class attribute::

    class SendSms(KafkaConsumer):
        topics = ("sms",)
        dedup = RedisDedup(lease=60, retention=timedelta(days=7))

The default, :class:`~mqdedup.dedup.choices.SqlDedup`, is the dedup table of the
consumer's ``table_prefix`` (the choices live in :mod:`mqdedup.dedup.choices`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker


@dataclass(slots=True)
class Claims:
    """What claiming a batch of message ids found.

    ``new``: ids claimed now (their handlers run). ``done``: ids already processed, each
    with its stored result when the store had it at hand (the SQL store reads results
    only on request, see :meth:`ClaimStore.results`). ``busy``: ids held by another
    worker right now, with the seconds left on its lease (Redis only; the SQL store
    makes a concurrent claim wait on the unique index instead). Every claimed id is in
    exactly one of them, except that ``done`` may omit ids whose result was not read.
    """

    new: set[str] = field(default_factory=set)
    done: dict[str, Any] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        """Refused: "did the claim find something" has three answers; ask ``new``,
        ``done`` or ``busy`` (``DedupStore.claim`` returned the new ids as a set before
        it became the claim store, and ``if store.claim(...)`` must not silently hold)."""
        raise TypeError("test Claims.new, .done or .busy, not the Claims itself")


class ClaimStore(Protocol):
    """Where claims live: claim ids, store results, forget claims, count attempts.

    ``unit`` is the store's unit of work, passed back to it on each call: a SQLAlchemy
    ``Session`` inside the business transaction (SQL), or the id of the worker holding
    the leases (Redis). Methods without ``unit`` run on their own (a short transaction
    of their own, one Redis round trip). Errors :meth:`is_transient` accepts are
    outages: the Processor waits them out and never counts them against a message.
    """

    #: True: claims commit in the handler's database transaction (the Processor runs
    #: handlers in that transaction, with ``ctx.session`` and ``ctx.outbox``). False:
    #: claims are leased outside any transaction and completed right after each handler.
    transactional: bool
    #: What an outage of this store is called in logs and on ``/healthz``.
    infrastructure: str

    @property
    def lease(self) -> float | None:
        """Seconds a claim is held without renewal (the Processor renews while it works
        through a batch); None: held until the transaction ends."""
        ...

    def is_transient(self, error: BaseException) -> bool:
        """True for errors worth waiting out (connection lost, failover, timeout)."""
        ...

    def claim(self, unit: Any, consumer: str, ids: Sequence[str]) -> Claims:
        """Claim ``ids`` (distinct) for ``consumer`` in one round trip."""
        ...

    def results(self, unit: Any, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """Stored results of processed ids (ids without a result are absent)."""
        ...

    def save_results(self, unit: Any, consumer: str, results: Mapping[str, Any]) -> None:
        """Mark claimed ids done with their JSON results (``None``: no result)."""
        ...

    def forget(self, unit: Any, consumer: str, ids: Sequence[str]) -> None:
        """Drop the claims of ids whose handler failed (they will be processed again)."""
        ...

    def renew(self, unit: Any, consumer: str, ids: Sequence[str]) -> None:
        """Extend the leases of claims ``unit`` still holds (nothing to do for SQL)."""
        ...

    def record_failure(self, consumer: str, message_id: str, error: str) -> int:
        """Count one failed handler attempt; return the attempts so far."""
        ...

    def forget_attempts(self, consumer: str, ids: Sequence[str]) -> None:
        """Drop attempt counts (a replay gives those messages their full retries)."""
        ...


@runtime_checkable
class AttemptLog(Protocol):
    """A claim store that can count an attempt before its handler runs (careful mode).

    Redelivered messages then run one at a time with their attempt committed first, so
    a handler that kills its worker reaches ``max_attempts`` (see
    :mod:`mqdedup.consumers.careful`). ``unit`` is a session of its own.
    """

    def processed(self, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """The ids among ``ids`` already processed, with their stored results (one read)."""
        ...

    def start_attempt(
        self, unit: Any, consumer: str, message_id: str, marker: str, max_attempts: int
    ) -> tuple[int, str | None, bool]:
        """Count an attempt first: ``(attempts, last error, started)``."""
        ...

    def finish_attempt(self, consumer: str, message_id: str, error: str) -> None:
        """Record how a counted attempt failed (no second count)."""
        ...

    def undo_attempt(self, consumer: str, message_id: str) -> None:
        """Take back a counted attempt whose handler never ran."""
        ...


class Dedup(Protocol):
    """A consumer's choice of claim store (its ``dedup`` class attribute)."""

    @property
    def needs_database(self) -> bool:
        """True when the store is the consumer's database (the worker needs one)."""
        ...

    def create_store(self, prefix: str, sessions: sessionmaker[Session] | None) -> ClaimStore:
        """The claim store of a consumer with table prefix ``prefix``."""
        ...

    def check(self) -> None:
        """Raise (one line) when the store cannot be reached (CLI start-up)."""
        ...

    def describe(self) -> str:
        """Why a consumer with this store has no database transaction (error texts)."""
        ...
