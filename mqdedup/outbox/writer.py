"""Placeholder for the outbox writer (see the outbox issue)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from mqdedup.schema import DEFAULT_PREFIX


class OutboxWriter:
    """Adds outgoing messages to the outbox table in the caller's session."""

    def __init__(
        self,
        session: Session,
        *,
        consumer_name: str | None = None,
        causation_id: str | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.session = session
        self.consumer_name = consumer_name
        self.causation_id = causation_id
        self.prefix = prefix

    def publish(self, *args: Any, **kwargs: Any) -> str:
        """Not available yet."""
        raise NotImplementedError("the outbox is not implemented yet")
