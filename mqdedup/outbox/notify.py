"""Wake-up of the relay: ``NOTIFY`` in the writer's transaction, delivered on commit.

On PostgreSQL the writer arranges one ``pg_notify(<prefix>outbox, '')`` per transaction
that wrote outbox rows. It is issued just before the outermost commit, inside the
transaction, so PostgreSQL delivers it exactly when (and only if) the rows become
visible. The relay ``LISTEN``s on a dedicated connection (see
:class:`~mqdedup.outbox.coordination.PostgreSQLCoordinator`) and polls as a fallback;
other databases are polled only.
"""

from __future__ import annotations

from sqlalchemy import event, text
from sqlalchemy.orm import Session, SessionTransaction

_PENDING_KEY = "mqdedup.outbox.notify_channels"
_HOOKED_KEY = "mqdedup.outbox.notify_hooked"
_NOTIFY = text("SELECT pg_notify(:channel, '')")


def channel_name(prefix: str) -> str:
    """The ``LISTEN``/``NOTIFY`` channel of the outbox table with ``prefix``."""
    return f"{prefix}outbox"


def notify_on_commit(session: Session, channel: str) -> None:
    """Send ``NOTIFY channel`` in ``session``'s transaction, once, just before it commits.

    Savepoint releases do not trigger it; the outermost commit does. A rolled-back
    transaction sends nothing (its pending channels are forgotten).
    """
    channels = session.info.get(_PENDING_KEY)
    if channels is None:
        channels = session.info[_PENDING_KEY] = set()
    channels.add(channel)
    if not session.info.get(_HOOKED_KEY):
        event.listen(session, "before_commit", _before_commit)
        event.listen(session, "after_transaction_end", _after_transaction_end)
        session.info[_HOOKED_KEY] = True


def _before_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a savepoint is being released; the outermost commit notifies
    channels = session.info.pop(_PENDING_KEY, None)
    if not channels:
        return
    for channel in sorted(channels):
        session.execute(_NOTIFY, {"channel": channel})


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        session.info.pop(_PENDING_KEY, None)
