"""The seam for broker positions stored in the business transaction.

A transport may keep, per partition, the position of the next record to process in a
row of the framework's schema (Kafka's ``offsets_in_database``). It then exposes a
:class:`Positions` as its ``positions`` attribute and the unit of work
(:mod:`mqdedup.consumers.transactions`) writes the position in the same transaction as
the batch's effects. The Processor asks it first which deliveries are already done
(below the stored position: known duplicates, without a claim).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from mqdedup.consumers.transport import Delivery

__all__ = ["PositionFencedError", "Positions"]


class PositionFencedError(Exception):
    """Another owner took the partition since this worker read its stored position.

    Raised by :meth:`Positions.write` (its conditional write matched no row): the
    transaction rolls back with every effect of the batch, the batch is given back and
    the worker reads the position again before its next batch of that partition.
    """


class Positions(Protocol):
    """Stored positions of a transport (see the module docs)."""

    #: Whether message ids are claimed as well (the id strategy names a producer id).
    claims: bool

    def done(
        self, sessions: sessionmaker[Session], deliveries: Sequence[Delivery[Any]]
    ) -> tuple[list[Delivery[Any]], list[Delivery[Any]]]:
        """``(done, again)``: the deliveries already done by the stored positions (known
        duplicates), and those to fetch again (their partition seeks back to its stored
        position).

        Reads (and takes ownership of) the stored position of each partition not read
        since it was assigned, in a transaction of its own.
        """
        ...

    def write(self, session: Session, deliveries: Sequence[Delivery[Any]]) -> Callable[[], None]:
        """In the caller's transaction: ``deliveries`` are done; one conditional write per
        partition. Raises :class:`PositionFencedError` when another owner took one.
        Returns what to call once the transaction committed."""
        ...

    def fenced(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """A write for these deliveries was fenced: read their positions again."""
        ...
