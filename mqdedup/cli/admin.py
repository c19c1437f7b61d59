"""Handlers of the operator sub-commands: demo, db, dedup, outbox, dead-letters, status."""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import timedelta

from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.cli.commands import RefusedError
from mqdedup.cli.commands.dead_letters import (
    delete_dead_letters,
    list_dead_letters,
    replay_dead_letters,
)
from mqdedup.cli.commands.operations import (
    count_purgeable_claims,
    count_purgeable_outbox_rows,
    dedup_stats,
    dedup_stats_data,
    format_dedup_stats,
    format_outbox_status,
    outbox_status_data,
)
from mqdedup.cli.commands.status import status_data, status_screen
from mqdedup.cli.demo import existing_demo_rows, format_summary, run_demo
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.options import (
    PURGE_CONFIRM_BELOW,
    PURGE_CONFIRM_TEXT,
    consumer_prefix,
    print_json,
    resolve_settings,
)
from mqdedup.cli.runners import _export_environment
from mqdedup.db.engine import check_connection, check_schema, create_engine, init_schema
from mqdedup.db.migrations import schema_drift, upgrade_schema
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import (
    ConfigurationError,
)
from mqdedup.masking import mask_text
from mqdedup.outbox.store import OutboxStore
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals


def connected_engine(
    args: argparse.Namespace, *, require_schema: bool = True
) -> tuple[Engine, str]:
    """A connected engine for the command's database, and the table prefix."""
    settings = resolve_settings(args)
    engine = create_engine(settings["database_url"])
    check_connection(engine)
    if require_schema:
        require_current_schema(engine, settings["table_prefix"])
    return engine, settings["table_prefix"]


def require_current_schema(engine: Engine, prefix: str) -> None:
    """Raise ConfigurationError naming the first mismatch of the tables with this version."""
    problems = check_schema(engine, prefix)
    if problems:
        raise ConfigurationError(f"the database does not match this mqdedup version: {problems[0]}")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.messages < 1:
        raise ConfigurationError("--messages must be at least 1")
    if not 0 <= args.duplicates <= 1 or not 0 <= args.crash_rate < 1:
        raise ConfigurationError("--duplicates must be in [0, 1] and --crash-rate in [0, 1)")
    if args.database:
        engine = create_engine(args.database)
        check_connection(engine)
        rows = existing_demo_rows(engine)
        engine.dispose()
        if rows and not args.force:
            raise RefusedError(
                f"demo_orders in {mask_text(args.database)} holds {rows:,} row(s): the demo "
                "drops and recreates it; pass --force to go on, or use another database"
            )
    if args.log_level.upper() == "WARNING":  # dead letters are listed in the summary instead
        logging.getLogger("mqdedup").setLevel(logging.ERROR)
    result = run_demo(
        messages=args.messages,
        duplicate_rate=args.duplicates,
        database_url=args.database,
        crash_rate=args.crash_rate,
        seed=args.seed,
        progress=sys.stderr,
    )
    print(format_summary(result))
    return exitcodes.OK if result.exactly_once and result.nothing_lost else exitcodes.CHECK_FAILED


def cmd_db_init(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args, require_schema=False)
    created = init_schema(engine, prefix)
    changed = upgrade_schema(engine, prefix)
    if created:
        print(f"created: {', '.join(created)}")
    for change in changed:
        print(change)
    if not (created or changed):
        print("schema is up to date")
    return exitcodes.OK


def cmd_db_check(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args, require_schema=False)
    problems = check_schema(engine, prefix) + [str(d) for d in schema_drift(engine, prefix)]
    for problem in problems:
        print(problem)
    if not problems:
        print("schema matches this version")
    return exitcodes.CHECK_FAILED if problems else exitcodes.OK


def cmd_dedup_purge(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    scope = f" of consumer {args.consumer!r}" if args.consumer else ""
    if args.dry_run:
        count = count_purgeable_claims(engine, prefix, args.older_than, args.consumer)
        print(f"would delete {count} dedup records{scope} older than {args.older_than} (dry run)")
        return exitcodes.OK
    if args.older_than < PURGE_CONFIRM_BELOW and not args.yes:
        _confirm_short_purge(args.older_than, scope)
    deleted = DedupStore(prefix).purge(
        engine, args.older_than, consumer=args.consumer, chunk_size=args.chunk_size
    )
    print(f"deleted {deleted} dedup records{scope} older than {args.older_than}")
    return exitcodes.OK


def _confirm_short_purge(older_than: timedelta, scope: str) -> None:
    """Ask on a terminal, refuse otherwise: a short horizon removes recent claims that
    redeliveries and replays rely on (messages of that window could be applied twice)."""
    risk = (
        f"--older-than {older_than} is below {PURGE_CONFIRM_TEXT}: redeliveries and replays "
        f"of messages newer than {PURGE_CONFIRM_TEXT} rely on these claims{scope}"
    )
    if not sys.stdin.isatty():
        raise RefusedError(f"{risk}; nothing deleted (pass --yes to confirm, --dry-run to count)")
    answer = input(f"{risk}. Delete them? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise RefusedError("not confirmed; nothing deleted")


def cmd_dedup_stats(args: argparse.Namespace) -> int:
    stats = dedup_stats(*connected_engine(args))
    if args.json:
        print_json(dedup_stats_data(*stats))
    else:
        print(format_dedup_stats(*stats))
    return exitcodes.OK


def cmd_outbox_status(args: argparse.Namespace) -> int:
    if args.json:
        print_json(outbox_status_data(*connected_engine(args)))
    else:
        print(format_outbox_status(*connected_engine(args)))
    return exitcodes.OK


def cmd_outbox_retry(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    count = OutboxStore(prefix).retry_failed(engine, ids=args.ids, destination=args.destination)
    print(f"{count} failed outbox row(s) back to pending")
    return exitcodes.OK


def cmd_outbox_purge(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    if args.dry_run:
        count = count_purgeable_outbox_rows(engine, prefix, args.older_than)
        print(
            f"would delete {count} published outbox row(s) older than {args.older_than} (dry run)"
        )
        return exitcodes.OK
    count = OutboxStore(prefix).purge(engine, args.older_than, chunk_size=args.chunk_size)
    print(f"deleted {count} published outbox row(s) older than {args.older_than}")
    return exitcodes.OK


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


def cmd_status(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    prefixes = {
        consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
    }
    engine, prefix = connected_engine(args, require_schema=False)
    if len(prefixes) == 1:  # the consumers' own tables, when they all agree
        prefix = prefixes.pop()
    require_current_schema(engine, prefix)
    data = status_data(engine, prefix, consumers)
    if args.json:
        print_json(data)
    else:
        print(status_screen(data))
    unreachable = [e for e in data["consumers"] if e["unreachable"]]
    if unreachable:  # the screen is printed; the exit code and one line say what is missing
        names = ", ".join(sorted({e["consumer"] for e in unreachable}))
        print(f"mqdedup: error: {unreachable[0]['error']} (lag unknown: {names})", file=sys.stderr)
        return exitcodes.BROKER_UNAVAILABLE
    return exitcodes.OK
