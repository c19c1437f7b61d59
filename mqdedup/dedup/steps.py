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
  the handler gets the recorded result instead of calling again. The result is kept as
  the JSON text the first run produced (``{"$json": "<text>"}`` in the ``result``
  column), so the rerun returns exactly the first run's value on every database
  (PostgreSQL's ``jsonb`` would reorder keys and rewrite numbers such as ``1e16``).

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
from mqdedup.errors import MessageError, MqdedupError

_KEY_NAMESPACE = uuid.UUID("9d3c2b8e-6f1a-5e0b-8c47-6964656d706b")
#: The longest step name (the table's key column).
MAX_STEP_NAME = 200
#: The deepest nesting of lists and dicts a step's result may have (JSON parsers,
#: Python's among them, recurse once per level).
MAX_RESULT_DEPTH = 100
STARTED = "started"
DONE = "done"
#: The call returned a value that cannot be recorded: a rerun does not call again.
UNSTORABLE = "unstorable"
#: The stored form of a result: ``{"$json": "<the JSON text>"}``. The text is kept as
#: the first run serialised it (PostgreSQL's ``jsonb`` would reorder keys and rewrite
#: numbers), so a rerun reads back exactly the value the first run returned.
_TEXT = "$json"
#: The stored form of an unstorable result: ``{"$unstorable": "<why>"}``.
_WHY = "$unstorable"


class InvalidStepError(MqdedupError, ValueError):
    """A step name that cannot be recorded (empty, longer than 200 characters, a NUL
    character or a lone surrogate)."""


class StepResultError(MessageError, MqdedupError, ValueError):
    """A step's call returned a value that cannot be recorded as JSON (a type JSON does
    not have, NaN or infinity, nesting deeper than :data:`MAX_RESULT_DEPTH`, a circular
    reference), or the database refused its record.

    The call was made once: the step is recorded as ``unstorable`` and the message is
    dead-lettered at once with this reason. A rerun of the message (a redelivery, a
    replay) raises it again **without calling** (delete the step's row to call again).
    """


def idempotency_key(consumer_name: str, message_id: str, name: str) -> str:
    """The key of the external call ``name`` made for one message by one consumer.

    32 lowercase hex characters (a name-based UUID, RFC 9562 version 5, without dashes),
    deterministic: the same consumer, message id and name give the same key in every
    process, on every rerun.
    """
    check_step_name(name)
    seed = f"{consumer_name}\x1f{message_id}\x1f{name}"
    return uuid.uuid5(_KEY_NAMESPACE, seed).hex


def check_step_name(name: object) -> str:
    """``name`` if it can name a step, else TypeError (not a ``str``) or InvalidStepError
    (empty or blank, longer than 200 characters, a NUL character, a lone surrogate)."""
    if not isinstance(name, str):
        raise TypeError(
            f"the name of a step or idempotency key must be a str, got {type(name).__name__}: "
            f"{name!r:.80}"
        )
    problem = None
    if not name.strip() or len(name) > MAX_STEP_NAME:
        problem = f"must be 1 to {MAX_STEP_NAME} characters"
    elif "\x00" in name:
        problem = "must not contain a NUL character"
    elif not _encodable(name):
        problem = "must not contain a lone surrogate (it is not valid Unicode text)"
    if problem is not None:
        raise InvalidStepError(f"a step name {problem}, got {name!r:.80}")
    return name


def check_step_function(fn: object) -> None:
    """TypeError unless ``fn`` is callable (``ctx.step(name, fn)``: ``fn(key)``)."""
    if not callable(fn):
        raise TypeError(
            f"ctx.step(name, fn): fn must be a callable taking the idempotency key, "
            f"got {type(fn).__name__}: {fn!r:.80}"
        )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def serialize(name: str, result: Any) -> str:
    """The JSON text of ``result``, as it is recorded; StepResultError if it has none.

    ASCII only (non-ASCII characters, NUL and lone surrogates are ``\\u`` escapes), so
    every database stores it as it is and it reads back as the same value.
    """
    problem = _too_deep(result)
    if problem is None:
        try:
            return json.dumps(result, allow_nan=False, ensure_ascii=True, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
    raise StepResultError(
        f"step {name!r} returned a value that cannot be recorded as JSON ({problem}); "
        "return plain data (dicts with str keys, lists, str, finite numbers, bool, None)"
    )


def _too_deep(value: Any) -> str | None:
    """Why ``value`` nests too deeply to be recorded; None if it does not (each container
    is looked at once: ``json.dumps`` reports a circular reference)."""
    if not isinstance(value, dict | list | tuple):
        return None
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen: set[int] = set()
    while stack:
        container, depth = stack.pop()
        if id(container) in seen:
            continue
        seen.add(id(container))
        if depth > MAX_RESULT_DEPTH:
            return f"nested deeper than {MAX_RESULT_DEPTH} levels"
        items = container.values() if isinstance(container, dict) else container
        stack.extend((item, depth + 1) for item in items if isinstance(item, dict | list | tuple))
    return None


def as_json(name: str, result: Any) -> Any:
    """``result`` as it will be read back from the record (a JSON round trip)."""
    return json.loads(serialize(name, result))


def stored(text: str) -> dict[str, str]:
    """What the ``result`` column holds for a result serialised as ``text``."""
    return {_TEXT: text}


def loaded(value: Any) -> Any:
    """The result a ``result`` column holds (rows recorded before results were kept as
    text hold the JSON value itself; they are read as they are)."""
    if isinstance(value, dict) and len(value) == 1:
        text = value.get(_TEXT)
        if isinstance(text, str):
            return json.loads(text)
    return value


def unstorable_reason(value: Any) -> str:
    """Why an ``unstorable`` step's result was not recorded."""
    if isinstance(value, dict) and isinstance(value.get(_WHY), str):
        return str(value[_WHY])
    return "unknown"


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
        the call. A step whose earlier call returned an unstorable value raises
        :class:`StepResultError` again (it is not called again)."""
        table = self.table
        key = (
            table.c.consumer_name == consumer,
            table.c.message_id == message_id,
            table.c.name == name,
        )
        row = connection.execute(select(table.c.state, table.c.result).where(*key)).first()
        if row is not None and row.state == DONE:
            return Recorded(loaded(row.result))
        if row is not None and row.state == UNSTORABLE:
            raise StepResultError(
                f"step {name!r} was called on an earlier run and returned a value that "
                f"could not be recorded ({unstorable_reason(row.result)}); it is not "
                "called again (delete its row from the steps table to call it again)"
            )
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
        self, connection: Connection, consumer: str, message_id: str, name: str, text: str
    ) -> None:
        """Mark the step done with its result, ``text`` as :func:`serialize` made it."""
        self._finish(connection, consumer, message_id, name, DONE, stored(text))

    def record_unstorable(
        self, connection: Connection, consumer: str, message_id: str, name: str, why: str
    ) -> None:
        """Mark the step called with a result that cannot be recorded (``why``): a rerun
        raises :class:`StepResultError` instead of calling again."""
        self._finish(connection, consumer, message_id, name, UNSTORABLE, {_WHY: _clean(why)})

    def _finish(
        self,
        connection: Connection,
        consumer: str,
        message_id: str,
        name: str,
        state: str,
        result: dict[str, str],
    ) -> None:
        table = self.table
        connection.execute(
            update(table)
            .where(
                table.c.consumer_name == consumer,
                table.c.message_id == message_id,
                table.c.name == name,
            )
            .values(state=state, result=result, completed_at=utcnow())
        )

    def recorded(self, connection: Connection, consumer: str, message_id: str) -> dict[str, Any]:
        """``{name: (state, attempts, result)}`` of one message's steps (for tests, tools)."""
        table = self.table
        rows = connection.execute(
            select(table.c.name, table.c.state, table.c.attempts, table.c.result).where(
                table.c.consumer_name == consumer, table.c.message_id == message_id
            )
        )
        return {row.name: (row.state, row.attempts, loaded(row.result)) for row in rows}


def _clean(text: str) -> str:
    """``text`` storable everywhere: printable ASCII with escapes, at most 1,000 characters."""
    return text.encode("unicode_escape").decode("ascii")[:1000]
