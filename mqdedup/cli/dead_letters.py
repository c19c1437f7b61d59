"""``mqdedup dead-letters``: list, show, replay, requeue and delete dead letters in all three
places (:mod:`mqdedup.deadletters`): the database table of dead letters the broker
refused (``--place database``, the default), Kafka dead-letter topics (``--place kafka``,
or ``--topic``) and RabbitMQ dead-letter queues (``--place rabbitmq``, or ``--queue``).

A replay runs the consumer's handler over dead letters again, after the cause is fixed,
through the same Worker and Processor as live messages and through its claims: a message
already processed is a duplicate, so replaying twice runs its effects once.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import connected_engine, require_current_schema
from mqdedup.cli.config import resolve_settings
from mqdedup.cli.exitcodes import UsageError
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.output import print_json, render_table
from mqdedup.cli.runners import _export_environment
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.replay import ParkedTransport
from mqdedup.consumers.worker import Worker
from mqdedup.db.engine import session_factory
from mqdedup.deadletters import (
    BODY_LIMIT,
    DatabaseDeadLetters,
    DeadLetterKeyError,
    DeadLetterPlace,
    DeadLetterRecord,
    ReplayOutcome,
    body_preview,
    group,
    replay,
)
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError
from mqdedup.masking import mask_text
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals

__all__ = [
    "ReplayOutcome",
    "cmd_dead_letters_delete",
    "cmd_dead_letters_list",
    "cmd_dead_letters_replay",
    "cmd_dead_letters_requeue",
    "cmd_dead_letters_show",
    "dead_letter_counts",
    "delete_dead_letters",
    "list_dead_letters",
    "replay_dead_letters",
]

_PREVIEW = 60
#: How many dead letters an action selects at most (``--error`` / ``--all``).
SELECT_LIMIT = 100_000


def _usage_errors(command: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """Bad keys and contradicting flags are command-line mistakes: exit code 2."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (UsageError, DeadLetterKeyError) as error:
            print(f"mqdedup: error: {mask_text(str(error))}", file=sys.stderr)
            return exitcodes.USAGE

    return run


# -- choosing the place -------------------------------------------------------------------


def place_name(args: argparse.Namespace) -> str:
    """``--place``, or what ``--topic`` / ``--queue`` imply; the database by default."""
    topics, queues = getattr(args, "topics", None), getattr(args, "queues", None)
    if topics and queues:
        raise UsageError("--topic (Kafka) and --queue (RabbitMQ) name different places: pick one")
    implied = "kafka" if topics else "rabbitmq" if queues else None
    chosen = getattr(args, "place", None)
    if chosen and implied and chosen != implied:
        raise UsageError(f"--place {chosen} contradicts --{'topic' if topics else 'queue'}")
    return str(chosen or implied or "database")


def open_place(
    args: argparse.Namespace, engine: Engine, prefix: str, consumer: Consumer | None = None
) -> DeadLetterPlace:
    """The place the command's flags name (a consumer's own topics / queue for replay)."""
    name = place_name(args)
    if name == "database":
        return DatabaseDeadLetters(engine, prefix)
    # The adapters (and their client libraries) only when a broker place is asked for.
    from mqdedup.kafka.dead_letter_topic import KafkaDeadLetterTopics
    from mqdedup.rabbitmq.dead_letter_queue import RabbitDeadLetterQueues

    settings = resolve_settings(args, "kafka_bootstrap", "rabbitmq_url")
    if name == "kafka":
        if consumer is not None and not args.topics and hasattr(consumer, "kafka_settings"):
            return KafkaDeadLetterTopics.for_consumer(consumer, engine)
        if not settings["kafka_bootstrap"]:
            raise ConfigurationError(
                "the kafka place needs the bootstrap servers: --kafka-bootstrap or "
                "MQDEDUP_KAFKA_BOOTSTRAP"
            )
        return KafkaDeadLetterTopics(
            settings["kafka_bootstrap"], engine, topics=args.topics or None, prefix=prefix
        )
    if consumer is not None and not args.queues and hasattr(consumer, "topology"):
        return RabbitDeadLetterQueues.for_consumer(consumer, engine)
    if not args.queues:
        raise UsageError("name the dead-letter queue(s) with --queue (e.g. --queue orders.dlq)")
    return RabbitDeadLetterQueues(
        settings["rabbitmq_url"], args.queues, engine=engine, prefix=prefix
    )


def select(
    place: DeadLetterPlace, args: argparse.Namespace, *, consumer: str | None
) -> list[DeadLetterRecord]:
    """The dead letters an action's flags choose: ``--key`` / ``--id``, or every one of
    the consumer's (``--all``) or of one group (``--error``)."""
    keys = [*(args.keys or ()), *(str(i) for i in (getattr(args, "ids", None) or ()))]
    if keys and (args.error or getattr(args, "all", False)):
        raise UsageError("choose dead letters by --key / --id, or by --error / --all, not both")
    if keys:
        found = [place.get(key) for key in dict.fromkeys(keys)]
        return [record for record in found if record is not None]
    records = place.list(consumer=consumer, limit=SELECT_LIMIT)
    if args.error:
        return [record for record in records if record.error == args.error]
    return records


# -- commands -----------------------------------------------------------------------------


@_usage_errors
def cmd_dead_letters_list(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    place = open_place(args, engine, prefix)
    if place.place == "database" and not args.groups and not args.json:
        print(list_dead_letters(engine, prefix, args.consumer, args.limit))
        return exitcodes.OK
    records = place.list(consumer=args.consumer, limit=args.limit)
    if args.groups:
        groups = group(records)
        if args.json:
            print_json(
                [
                    {
                        "consumer": consumer,
                        "error": error,
                        "count": len(members),
                        "keys": [r.key for r in members],
                    }
                    for (consumer, error), members in groups.items()
                ]
            )
        else:
            print(_groups_table(groups) if groups else _none(place.place, args.consumer))
        return exitcodes.OK
    if args.json:
        print_json([record_data(record, 0) for record in records])
    else:
        print(records_table(records) if records else _none(place.place, args.consumer))
    return exitcodes.OK


@_usage_errors
def cmd_dead_letters_show(args: argparse.Namespace) -> int:
    if args.body_limit < 0:
        raise UsageError("--body-limit must be zero or more")
    engine, prefix = connected_engine(args)
    place = open_place(args, engine, prefix)
    record = place.get(args.key)
    if record is None:
        print(
            f"mqdedup: error: no dead letter {args.key!r} in the {place.place} place",
            file=sys.stderr,
        )
        return exitcodes.CHECK_FAILED
    if args.json:
        print_json(record_data(record, args.body_limit))
    else:
        print(record_text(record, args.body_limit))
    return exitcodes.OK


@_usage_errors
def cmd_dead_letters_replay(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    _export_environment(settings)
    consumer = create_consumer(args.consumer)
    consumer.validate()
    engine, _ = connected_engine(args, require_schema=False)
    require_current_schema(engine, consumer.table_prefix)
    place = open_place(args, engine, consumer.table_prefix, consumer)
    records = select(place, args, consumer=consumer.consumer_name)
    if not records:
        print(f"no dead letters of {consumer.consumer_name} to replay in the {place.place} place")
        return exitcodes.OK
    stop = StopToken()
    try:
        with graceful_signals(stop):
            outcome = replay(records, consumer, engine, place, stop=stop)
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    print(outcome)
    return exitcodes.DEAD_LETTERED if outcome.dead_lettered_again else exitcodes.OK


@_usage_errors
def cmd_dead_letters_requeue(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    place = open_place(args, engine, prefix)
    _require_choice(args)
    records = select(place, args, consumer=args.consumer)
    moved = place.requeue([record.key for record in records])
    print(f"requeued {moved} of {len(records)} dead letter(s) to their source")
    return exitcodes.OK if moved == len(records) else exitcodes.CHECK_FAILED


@_usage_errors
def cmd_dead_letters_delete(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    place = open_place(args, engine, prefix)
    _require_choice(args)
    if place.place == "database" and args.all and not args.error:
        if not args.consumer:
            raise UsageError(
                "--all deletes every dead letter of one consumer: name it (--consumer)"
            )
        count = delete_dead_letters(engine, prefix, args.consumer, None, True)
        print(f"deleted {count} kept dead letter(s) of {args.consumer}")
        return exitcodes.OK
    if args.all and not args.consumer:
        raise UsageError("--all deletes every dead letter of one consumer: name it (--consumer)")
    records = select(place, args, consumer=args.consumer)
    if args.consumer:
        records = [r for r in records if r.consumer == args.consumer]
    count = place.delete([record.key for record in records])
    scope = f" of {args.consumer}" if args.consumer else ""
    print(f"deleted {count} dead letter(s){scope} from the {place.place} place")
    return exitcodes.OK


def _require_choice(args: argparse.Namespace) -> None:
    if not (args.keys or getattr(args, "ids", None) or args.error or args.all):
        raise UsageError("name the dead letters with --key (or --id), --error TEXT, or pass --all")


# -- what is printed ----------------------------------------------------------------------


def records_table(records: Sequence[DeadLetterRecord]) -> str:
    """One line per dead letter."""
    return render_table(
        ["key", "consumer", "message id", "from", "attempts", "error", "dead-lettered"],
        [
            (
                record.key,
                record.consumer,
                record.message_id,
                record.source,
                record.attempts,
                _short(record.error),
                record.dead_lettered_at.isoformat(timespec="seconds")
                if record.dead_lettered_at
                else None,
            )
            for record in records
        ],
    )


def _groups_table(groups: dict[tuple[str | None, str], list[DeadLetterRecord]]) -> str:
    return render_table(
        ["consumer", "error", "count", "first key"],
        [
            (consumer, error, len(members), members[0].key)
            for (consumer, error), members in groups.items()
        ],
    )


def record_data(record: DeadLetterRecord, body_limit: int = BODY_LIMIT) -> dict[str, Any]:
    """A dead letter as JSON (``body``: at most ``body_limit`` bytes, as text)."""
    preview = body_preview(record.body, body_limit)
    return {
        "place": record.place,
        "key": record.key,
        "consumer": record.consumer,
        "source": record.source,
        "message_id": record.message_id,
        "error": record.error,
        "reason": record.reason,
        "attempts": record.attempts,
        "dead_lettered_at": record.dead_lettered_at.isoformat()
        if record.dead_lettered_at
        else None,
        "refusal": record.refusal,
        "headers": {name: mask_text(value) for name, value in record.headers.items()},
        "size": preview.size,
        "body": preview.text,
        "body_truncated": preview.truncated,
    }


def record_text(record: DeadLetterRecord, body_limit: int = BODY_LIMIT) -> str:
    """``show``: every field, the headers, the body (cut at ``body_limit`` bytes)."""
    data = record_data(record, body_limit)
    lines = [
        f"{label}: {_printable(str(data[name])) if data[name] is not None else '-'}"
        for label, name in (
            ("place", "place"),
            ("key", "key"),
            ("consumer", "consumer"),
            ("message id", "message_id"),
            ("from", "source"),
            ("error", "error"),
            ("reason", "reason"),
            ("attempts", "attempts"),
            ("dead-lettered at", "dead_lettered_at"),
            ("broker refusal", "refusal"),
        )
        if name != "refusal" or data[name] is not None
    ]
    lines.append("headers:" if data["headers"] else "headers: none")
    lines.extend(
        f"  {_printable(name)}: {_printable(value)}"
        for name, value in sorted(data["headers"].items())
    )
    lines.append(f"body ({data['size']} bytes):")
    lines.append(_printable(data["body"], keep="\n\t"))
    if data["body_truncated"]:
        lines.append(f"… truncated: {body_limit} of {data['size']} bytes shown (--body-limit)")
    return "\n".join(lines)


def _printable(text: str, keep: str = "") -> str:
    """``text`` with control characters escaped (``\\x1b``): a body or header can never
    move the cursor or recolour the operator's terminal."""
    return "".join(
        char if char.isprintable() or char in keep else repr(char)[1:-1] for char in text
    )


def _none(place: str, consumer: str | None) -> str:
    scope = f" for consumer {consumer!r}" if consumer else ""
    return f"no dead letters in the {place} place{scope}"


# -- the database place, as before (kept for scripts and tests) ----------------------------


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
