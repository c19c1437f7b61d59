"""Idempotency keys and recorded steps: external calls made once per message and name.

The dedup table protects what a handler writes to its own database; it cannot take
back a call to someone else (a payment gateway, an e-mail service, a partner API). Two
tools cover such a call:

* :func:`idempotency_key`: a key per consumer, message id and call name, the same
  across redeliveries, replays and crash reruns, different per consumer and per name.
  Pass it to the third party so that *it* deduplicates: an ``Idempotency-Key`` header
  (Stripe, Adyen, PayPal-Request-Id...), or the merchant order number / out-trade-no of
  a payment API (one number, one successful payment). It is 32 lowercase hex
  characters: it fits the common limits (Stripe 255, WeChat Pay ``out_trade_no`` 32,
  Alipay 64) and character sets.
* a *step* (``ctx.step(name, fn)``, run by :mod:`mqdedup.consumers.steps`): the call's
  result recorded in ``<prefix>steps`` in a short transaction of its own, so a rerun of
  the handler gets the recorded result instead of calling again.

:class:`StepStore` holds the statements; each method runs on the connection it is
given (the step runner opens its own short transactions on the consumer's engine).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import utcnow
from mqdedup.errors import MqdedupError

_KEY_NAMESPACE = uuid.UUID("9d3c2b8e-6f1a-5e0b-8c47-6964656d706b")
#: The longest step name (the table's key column).
MAX_STEP_NAME = 200
STARTED = "started"
DONE = "done"


class InvalidStepError(MqdedupError, ValueError):
    """A step name that cannot be recorded (empty, longer than 200 characters)."""


class StepResultError(MqdedupError, ValueError):
    """A step's call returned a value that cannot be recorded as JSON. The call was
    made; the message fails, and its rerun calls again with the same idempotency key."""


def idempotency_key(consumer_name: str, message_id: str, name: str) -> str:
    """The key of the external call ``name`` made for one message by one consumer.

    32 lowercase hex characters (a name-based UUID, RFC 9562 version 5, without dashes),
    deterministic: the same consumer, message id and name give the same key in every
    process, on every rerun.
    """
    check_step_name(name)
    seed = f"{consumer_name}\x1f{message_id}\x1f{name}"
    return uuid.uuid5(_KEY_NAMESPACE, seed).hex


def check_step_name(name: str) -> str:
    """``name`` if it can name a step (1 to 200 characters), else InvalidStepError."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_STEP_NAME:
        raise InvalidStepError(
            f"a step name must be 1 to {MAX_STEP_NAME} characters, got {name!r:.80}"
        )
    return name


def as_json(name: str, result: Any) -> Any:
    """``result`` as it will be read back from the record (a JSON round trip)."""
    try:
        return json.loads(json.dumps(result, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise StepResultError(
            f"step {name!r} returned a value that cannot be recorded as JSON "
            f"({type(exc).__name__}: {exc}); return plain data (dicts, lists, str, numbers)"
        ) from None


@dataclass(frozen=True)
class Recorded:
    """A step already done: its recorded result."""

    result: Any


class StepStore:
    """Reads and writes ``<prefix>steps``: one row per consumer, message id and name."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.table = schema(prefix).steps

    def start(
        self, connection: Connection, consumer: str, message_id: str, name: str
    ) -> Recorded | None:
        """The recorded result if the step is done; else mark it started (one more
        attempt) and return None. Run it in a transaction of its own, committed before
        the call."""
        table = self.table
        key = (
            table.c.consumer_name == consumer,
            table.c.message_id == message_id,
            table.c.name == name,
        )
        row = connection.execute(select(table.c.state, table.c.result).where(*key)).first()
        if row is not None and row.state == DONE:
            return Recorded(row.result)
        if row is None:
            try:
                with connection.begin_nested():
                    connection.execute(
                        insert(table).values(
                            consumer_name=consumer,
                            message_id=message_id,
                            name=name,
                            state=STARTED,
                            attempts=1,
                            started_at=utcnow(),
                        )
                    )
                return None
            except IntegrityError:  # another run of the message started it meanwhile
                return self.start(connection, consumer, message_id, name)
        connection.execute(
            update(table).where(*key).values(attempts=table.c.attempts + 1, started_at=utcnow())
        )
        return None

    def record(
        self, connection: Connection, consumer: str, message_id: str, name: str, result: Any
    ) -> None:
        """Mark the step done with its (JSON) ``result``."""
        table = self.table
        connection.execute(
            update(table)
            .where(
                table.c.consumer_name == consumer,
                table.c.message_id == message_id,
                table.c.name == name,
            )
            .values(state=DONE, result=result, completed_at=utcnow())
        )

    def recorded(self, connection: Connection, consumer: str, message_id: str) -> dict[str, Any]:
        """``{name: (state, attempts, result)}`` of one message's steps (for tests, tools)."""
        table = self.table
        rows = connection.execute(
            select(table.c.name, table.c.state, table.c.attempts, table.c.result).where(
                table.c.consumer_name == consumer, table.c.message_id == message_id
            )
        )
        return {row.name: (row.state, row.attempts, row.result) for row in rows}
