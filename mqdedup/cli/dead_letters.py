"""``mqdedup dead-letters``: list, replay and delete the dead letters kept in the database
because the broker refused them (:mod:`mqdedup.dedup.dead_letters`); replaying one runs
the consumer's handler over it again, after the cause is fixed, through the same Worker
and Processor as live messages, with its attempts counted anew."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import connected_engine, require_current_schema
from mqdedup.cli.config import resolve_settings
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.output import render_table
from mqdedup.cli.runners import _export_environment
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.replay import ParkedTransport
from mqdedup.consumers.worker import Worker
from mqdedup.db.engine import session_factory
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals

_PREVIEW = 60


def cmd_dead_letters_list(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    print(list_dead_letters(engine, prefix, args.consumer, args.limit))
    return exitcodes.OK


def cmd_dead_letters_replay(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    _export_environment(settings)
    consumer = create_consumer(args.consumer)
    consumer.validate()
    engine, _ = connected_engine(args, require_schema=False)
    require_current_schema(engine, consumer.table_prefix)
    stop = StopToken()
    try:
        with graceful_signals(stop):
            outcome = replay_dead_letters(consumer, engine, ids=args.ids, stop=stop)
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    print(outcome)
    return exitcodes.OK


def cmd_dead_letters_delete(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    count = delete_dead_letters(engine, prefix, args.consumer, args.ids, args.all)
    print(f"deleted {count} kept dead letter(s) of {args.consumer}")
    return exitcodes.OK


def list_dead_letters(
    engine: Engine, prefix: str, consumer: str | None = None, limit: int = 100
) -> str:
    """A table of kept dead letters (oldest first), or a line saying there are none."""
    table = DeadLetterTable(prefix)
    with Session(engine) as session:
        rows = table.list(session, consumer, limit=limit)
    if not rows:
        scope = f" for consumer {consumer!r}" if consumer else ""
        return f"no dead letters kept in the database{scope}"
    return render_table(
        ["id", "consumer", "message id", "from", "attempts", "reason", "broker refusal", "kept at"],
        [
            (
                row.id,
                row.consumer_name,
                row.message.id or "-",
                row.message.coordinates,
                row.attempts,
                _short(row.reason),
                _short(row.refusal),
                row.parked_at.isoformat(timespec="seconds"),
            )
            for row in rows
        ],
    )


def dead_letter_counts(engine: Engine, prefix: str) -> dict[str, int]:
    """Kept dead letters per consumer name."""
    with Session(engine) as session:
        return DeadLetterTable(prefix).counts(session)


@dataclass
class ReplayOutcome:
    """What replaying kept dead letters did."""

    handed_out: int = 0
    processed: int = 0
    duplicates: int = 0
    dead_lettered_again: int = 0
    removed: int = 0

    def __str__(self) -> str:
        return (
            f"replayed {self.handed_out} kept dead letter(s): {self.processed} processed, "
            f"{self.duplicates} already processed, {self.dead_lettered_again} failed again "
            f"(still kept); {self.removed} removed from the table"
        )


def replay_dead_letters(
    consumer: Consumer,
    engine: Engine,
    *,
    ids: Sequence[int] | None = None,
    stop: StopToken | None = None,
) -> ReplayOutcome:
    """Run ``consumer`` over its kept dead letters (all, or the rows ``ids``)."""
    prefix = consumer.table_prefix
    sessions: sessionmaker[Session] = session_factory(engine)
    _reset_attempts(sessions, prefix, consumer.consumer_name, ids)
    transport = ParkedTransport(sessions, consumer.consumer_name, prefix=prefix, ids=ids)
    metrics = Worker(consumer, transport, sessions, stop=stop).run(until_idle=True)
    return ReplayOutcome(
        handed_out=metrics.delivered,
        processed=metrics.processed,
        duplicates=metrics.duplicates,
        dead_lettered_again=transport.dead_lettered_again,
        removed=transport.settled,
    )


def delete_dead_letters(
    engine: Engine, prefix: str, consumer: str, ids: Sequence[int] | None, everything: bool
) -> int:
    """Delete kept dead letters of ``consumer``: the rows ``ids``, or all with ``everything``."""
    if not ids and not everything:
        raise ConfigurationError("name the rows to delete with --id, or pass --all")
    table = DeadLetterTable(prefix)
    with Session(engine) as session, session.begin():
        if everything:
            return table.delete_all(session, consumer)
        mine = {row.id for row in table.list(session, consumer, ids=ids, limit=len(ids or ()))}
        return table.delete(session, sorted(mine))


def _reset_attempts(
    sessions: sessionmaker[Session], prefix: str, consumer: str, ids: Sequence[int] | None
) -> None:
    """Forget the attempt counts of the messages to replay: each gets its full retries."""
    table = DeadLetterTable(prefix)
    store = DedupStore(prefix)
    with sessions() as session, session.begin():
        after = 0
        while rows := table.list(session, consumer, after_id=after, ids=ids, limit=500):
            after = rows[-1].id
            store.forget_attempts(
                consumer, [row.message.id for row in rows if row.message.id is not None], session
            )


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _PREVIEW else flat[: _PREVIEW - 1] + "…"
