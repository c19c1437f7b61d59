"""The web side of the flash sale: an order form with a one-time token, and placing the
order without selling a unit twice.

* ``open_form(user)`` issues a one-time token for the form (``DatabaseTokenStore``).
* ``place_order(...)`` consumes the token **in the order's transaction** (a double click,
  a browser retry or a replayed request finds it ``already used`` and places nothing),
  takes the stock, writes the order ``RESERVED`` and its ``order placed`` message in the
  outbox, and commits all of it at once. The relay publishes the message afterwards.

Two ways to take the stock, both correct under any number of concurrent buyers:

* ``conditional`` (**recommended**): one statement,
  ``UPDATE stock SET available = available - :n WHERE sku = :sku AND available >= :n``.
  The row lock PostgreSQL takes for the UPDATE serialises the buyers of a SKU for the
  length of one transaction; the condition makes overselling impossible; no lock
  service, no lease to size, nothing to expire under a slow buyer. 0 rows: sold out.
* ``lock``: a lease lock per SKU with a fencing token (``mqdedup.locks``): hold the lock,
  stamp the stock row with the token (``fenced_update``: refused if a later holder
  stamped it), read the stock, write ``available - n``. Correct too, but every buyer
  pays the lock's round trips on top of the row lock the stamp takes anyway, and the
  lease must outlast the critical section. It earns its keep only when the decision
  cannot be one conditional write (a check against another system between the read and
  the write). Without the fencing token it would be unsafe: a holder paused past its
  lease writes a stale count over the next holder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.orm import Session

from examples import settings
from examples.flash_sale import config
from mqdedup.dedup.tokens import DatabaseTokenStore, TokenOutcome
from mqdedup.id_generators import new_message_id
from mqdedup.locks import LeaseLock, fenced_update
from mqdedup.outbox.writer import OutboxWriter

FORM_TTL_SECONDS = 600


class Placed(StrEnum):
    """What a buyer is told."""

    PLACED = "placed"
    SOLD_OUT = "sold out"
    RESUBMITTED = "already submitted"  # the form's token was used: the first submit counts
    FORM_EXPIRED = "form expired"  # expired or unknown token: reload the form


@dataclass(frozen=True)
class Answer:
    """The outcome, and the order's id when one was placed."""

    outcome: Placed
    order_id: str | None = None


class Shop:
    """The order form and the checkout on ``engine``."""

    def __init__(self, engine: Engine, *, strategy: str = "conditional") -> None:
        if strategy not in ("conditional", "lock"):
            raise ValueError(f"strategy must be 'conditional' or 'lock', got {strategy!r}")
        self.engine = engine
        self.strategy = strategy
        self.tokens = DatabaseTokenStore(engine, prefix=settings.mqdedup_prefix())
        self.stock, self.orders = config.tables()

    def open_form(self, user: str) -> str:
        """The order form's one-time token for ``user``."""
        return self.tokens.issue(user, FORM_TTL_SECONDS)

    def place_order(
        self, user: str, form_token: str, sku: str, quantity: int, lock: LeaseLock | None = None
    ) -> Answer:
        """Place the order once per form; ``lock`` (the SKU's) for the ``lock`` strategy."""
        if self.strategy == "lock":
            if lock is None:
                raise ValueError("the lock strategy needs the SKU's lock")
            with lock.hold(timeout=30) as lease:
                return self._place(user, form_token, sku, quantity, fence=lease.token)
        return self._place(user, form_token, sku, quantity, fence=None)

    def _place(
        self, user: str, form_token: str, sku: str, quantity: int, fence: int | None
    ) -> Answer:
        with Session(self.engine) as session, session.begin():
            used = self.tokens.consume(user, form_token, session=session)
            if used is TokenOutcome.ALREADY_USED:
                return Answer(Placed.RESUBMITTED)
            if used is not TokenOutcome.CONSUMED:
                return Answer(Placed.FORM_EXPIRED)
            taken = (
                self._take_conditionally(session, sku, quantity)
                if fence is None
                else self._take_fenced(session, sku, quantity, fence)
            )
            if not taken:
                return Answer(Placed.SOLD_OUT)  # the form is used up with the answer
            order_id = new_message_id()
            session.execute(
                insert(self.orders).values(
                    order_id=order_id,
                    user_id=user,
                    sku=sku,
                    quantity=quantity,
                    status=config.RESERVED,
                    version=1,
                )
            )
            OutboxWriter(session, prefix=settings.mqdedup_prefix()).publish(
                {
                    "order_id": order_id,
                    "user": user,
                    "sku": sku,
                    "quantity": quantity,
                    "amount_cents": quantity * config.PRICE_CENTS,
                },
                exchange="",
                routing_key=config.orders_queue(),
                message_id=f"order-placed-{order_id}",
            )
            return Answer(Placed.PLACED, order_id)

    def _take_conditionally(self, session: Session, sku: str, quantity: int) -> bool:
        stock = self.stock
        taken = session.execute(
            update(stock)
            .where(stock.c.sku == sku, stock.c.available >= quantity)
            .values(available=stock.c.available - quantity)
        )
        return bool(taken.rowcount)  # type: ignore[attr-defined]

    def _take_fenced(self, session: Session, sku: str, quantity: int, fence: int) -> bool:
        stock = self.stock
        where = stock.c.sku == sku
        # The token is written first, before the read: a paused earlier holder's write
        # (its token smaller) is refused from now on, even before this write happens.
        # Fencing only the final write would let an earlier holder's write slip in
        # between this holder's read and its write (a lost update).
        fenced_update(session, stock, where, {}, fence)
        available = session.execute(select(stock.c.available).where(where)).scalar_one()
        if available < quantity:
            return False
        session.execute(update(stock).where(where).values(available=available - quantity))
        return True
