"""Dead letters kept in the database: the ones the broker refused.

A dead letter normally goes to the broker (``<queue>.dlq``, ``<topic>.DLT``). When the
broker refuses that one record for good — larger than the topic allows, rejected by a
queue policy, not authorised — the processor keeps the original message in
``<prefix>dead_letters`` instead (:meth:`DeadLetterTable.park`, in a transaction of its
own) and settles the delivery, so the partition or queue behind it moves on and nothing
is lost. ``mqdedup dead-letters list | replay | delete`` read and drain the table.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import RowMapping, delete, func, select
from sqlalchemy.orm import Session

from mqdedup.db import dialects
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import clean_text, id_chunks, utcnow
from mqdedup.message import HeaderValue, Message

#: Longest reason / error text kept (the full text is in the worker's log).
_TEXT_LIMIT = 4000


@dataclass(frozen=True)
class ParkedDeadLetter:
    """One row of the dead-letter table: the original message and why it is there."""

    id: int
    consumer_name: str
    message: Message
    reason: str
    attempts: int
    error_class: str | None
    error_message: str | None
    refusal: str
    parked_at: datetime


@dataclass(frozen=True)
class DeadLetterCause:
    """Why a message was dead-lettered, and why the broker would not take it."""

    reason: str
    attempts: int
    refusal: str
    error_class: str | None = None
    error_message: str | None = None


class DeadLetterTable:
    """Reads and writes ``<prefix>dead_letters`` (see the module docstring)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.table = schema(prefix).dead_letters

    def park(
        self, session: Session, consumer: str, message: Message, cause: DeadLetterCause
    ) -> None:
        """Keep ``message`` with ``cause`` in the caller's transaction.

        A message id already kept for ``consumer`` is not kept twice (a redelivery of a
        message whose settle was lost after parking).
        """
        dialects.insert_unless_present(
            session,
            self.table,
            {
                "consumer_name": consumer,
                "message_id": message.id,
                "source": clean_text(message.source),
                "source_partition": message.partition,
                "source_offset": message.offset,
                "message_key": message.key,
                "headers": encode_headers(message.headers),
                "properties": _plain_json(message.properties) if message.properties else None,
                "body": message.body,
                "reason": clean_text(cause.reason)[:_TEXT_LIMIT],
                "attempts": cause.attempts,
                "error_class": cause.error_class,
                "error_message": (
                    clean_text(cause.error_message)[:_TEXT_LIMIT]
                    if cause.error_message is not None
                    else None
                ),
                "refusal": clean_text(cause.refusal)[:_TEXT_LIMIT],
                "parked_at": utcnow(),
            },
        )

    def list(
        self,
        session: Session,
        consumer: str | None = None,
        *,
        after_id: int = 0,
        ids: Sequence[int] | None = None,
        limit: int = 100,
    ) -> list[ParkedDeadLetter]:
        """Kept dead letters in the order they were kept, ``limit`` at a time."""
        table = self.table
        query = select(table).where(table.c.id > after_id).order_by(table.c.id).limit(limit)
        if consumer is not None:
            query = query.where(table.c.consumer_name == consumer)
        if ids is not None:
            query = query.where(table.c.id.in_(list(ids)))
        return [_row_to_parked(row._mapping) for row in session.execute(query)]

    def counts(self, session: Session) -> dict[str, int]:
        """How many dead letters are kept, per consumer name."""
        table = self.table
        rows = session.execute(
            select(table.c.consumer_name, func.count()).group_by(table.c.consumer_name)
        )
        return {name: int(count) for name, count in rows}

    def delete(self, session: Session, ids: Iterable[int]) -> int:
        """Remove kept dead letters by row id; returns how many were removed."""
        removed = 0
        for chunk in id_chunks(session, ids):  # as many as a replay's batch
            result = session.execute(delete(self.table).where(self.table.c.id.in_(chunk)))
            removed += int(getattr(result, "rowcount", 0) or 0)
        return removed

    def delete_all(self, session: Session, consumer: str) -> int:
        """Remove every kept dead letter of ``consumer``."""
        result = session.execute(delete(self.table).where(self.table.c.consumer_name == consumer))
        return int(getattr(result, "rowcount", 0) or 0)


def encode_headers(headers: Mapping[str, HeaderValue]) -> list[list[str | None]]:
    """Headers as JSON ``[name, kind, value]``: text (``s``), base64 of bytes (``b``),
    base64 of text no database would store as it is (``u``: NUL, lone surrogates), or
    ``n`` for a header without a value."""
    encoded: list[list[str | None]] = []
    for name, value in headers.items():
        key = clean_text(str(name))
        if value is None:
            encoded.append([key, "n", None])
        elif isinstance(value, bytes):
            encoded.append([key, "b", base64.b64encode(value).decode("ascii")])
        elif clean_text(value) == value:
            encoded.append([key, "s", value])
        else:
            raw = value.encode("utf-8", "surrogatepass")
            encoded.append([key, "u", base64.b64encode(raw).decode("ascii")])
    return encoded


def decode_headers(encoded: Sequence[Sequence[Any]]) -> dict[str, HeaderValue]:
    """The inverse of :func:`encode_headers`."""
    headers: dict[str, HeaderValue] = {}
    for name, kind, value in encoded:
        if kind == "b":
            headers[str(name)] = base64.b64decode(value)
        elif kind == "u":
            headers[str(name)] = base64.b64decode(value).decode("utf-8", "surrogatepass")
        elif kind == "n":
            headers[str(name)] = None
        else:
            headers[str(name)] = str(value)
    return headers


def _plain_json(value: Mapping[str, Any]) -> Any:
    """AMQP properties as plain JSON (values JSON cannot hold become text)."""
    return json.loads(clean_text(json.dumps(dict(value), default=str)))


def _row_to_parked(row: RowMapping) -> ParkedDeadLetter:
    message = Message(
        body=bytes(row["body"]),
        id=row["message_id"],
        key=bytes(row["message_key"]) if row["message_key"] is not None else None,
        headers=decode_headers(row["headers"] or []),
        properties=dict(row["properties"] or {}),
        source=row["source"],
        partition=row["source_partition"],
        offset=row["source_offset"],
    )
    return ParkedDeadLetter(
        id=int(row["id"]),
        consumer_name=row["consumer_name"],
        message=message,
        reason=row["reason"],
        attempts=int(row["attempts"]),
        error_class=row["error_class"],
        error_message=row["error_message"],
        refusal=row["refusal"],
        parked_at=row["parked_at"],
    )
