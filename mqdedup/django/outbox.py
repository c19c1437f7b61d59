"""``ctx.outbox`` outside a consumer: outgoing messages from a Django view.

::

    from django.db import transaction
    from mqdedup.django import outbox

    @transaction.atomic
    def place_order(request):
        order = Order.objects.create(...)
        outbox().publish({"order": order.pk}, topic="order-events", key=str(order.pk))

The rows are written in the view's atomic block (each call in a savepoint of it), so
they commit or roll back with the order; the relay publishes them after the commit.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connections  # type: ignore[import-untyped]

from mqdedup.django.conf import database_alias, table_prefix
from mqdedup.django.connection import session
from mqdedup.errors import ConfigurationError
from mqdedup.outbox.writer import OutboxWriter, OutgoingMessage


class AtomicOutboxWriter(OutboxWriter):
    """An :class:`OutboxWriter` whose rows join the atomic block open on its alias."""

    def __init__(self, alias: str) -> None:
        super().__init__(session(alias), prefix=table_prefix())
        self.alias = alias

    def publish_many(self, messages: Iterable[OutgoingMessage]) -> list[str]:
        """Write the messages in a savepoint of the open atomic block; their ids."""
        require_atomic_block(self.alias)
        with self.session.begin():
            return super().publish_many(messages)


def require_atomic_block(alias: str) -> None:
    """Raise unless a ``transaction.atomic()`` block is open on ``alias``."""
    if not connections[alias].in_atomic_block:
        raise ConfigurationError(
            "mqdedup.django.outbox() needs an open transaction.atomic() block on database "
            f"{alias!r}: outside one the rows would commit on their own, not with your "
            "model writes (use @transaction.atomic or ATOMIC_REQUESTS)"
        )


def outbox(using: str | None = None) -> AtomicOutboxWriter:
    """A writer of outgoing messages in the atomic block open on ``using``.

    Message ids are random UUIDs unless given (``message_id=...``): pass one derived
    from your data (e.g. ``f"order-{order.pk}-placed"``) to make a retried request
    write the same id.
    """
    alias = database_alias(using)
    require_atomic_block(alias)
    return AtomicOutboxWriter(alias)
