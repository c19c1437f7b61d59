"""The ``mqdedup`` command.

User mistakes end with one line on stderr and a documented exit code
(:mod:`mqdedup.cli.exitcodes`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine

from mqdedup import __version__
from mqdedup.cli import exitcodes
from mqdedup.cli.commands import RefusedError
from mqdedup.cli.commands.dead_letters import (
    delete_dead_letters,
    list_dead_letters,
    replay_dead_letters,
)
from mqdedup.cli.commands.operations import (
    OutboxGauges,
    count_purgeable_claims,
    count_purgeable_outbox_rows,
    dedup_stats,
    dedup_stats_data,
    format_dedup_stats,
    format_outbox_status,
    outbox_status_data,
)
from mqdedup.cli.commands.reachability import check_relay_brokers, wait_for_consumer_broker
from mqdedup.cli.commands.replay import (
    format_replay_report,
    parse_position,
    replay_kafka,
    replay_stream,
    requeue_from_dlq,
)
from mqdedup.cli.commands.status import status_data, status_screen
from mqdedup.cli.config import (
    CONFIG_ENV,
    consumer_table_prefix,
    env_help,
    load_file,
    resolve,
    resolve_with_source,
    use_table_prefix,
)
from mqdedup.cli.demo import existing_demo_rows, format_summary, run_demo
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.publishers import create_publishers
from mqdedup.cli.runners import _export_environment
from mqdedup.cli.supervisor import ChildSpec, Supervisor
from mqdedup.consumers.base import Consumer
from mqdedup.db.engine import check_connection, check_schema, create_engine, init_schema
from mqdedup.db.migrations import schema_drift, upgrade_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import (
    ConfigurationError,
    MqdedupError,
)
from mqdedup.logs import configure as configure_logging
from mqdedup.masking import mask_text
from mqdedup.outbox.store import OutboxStore
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals

log = logging.getLogger("mqdedup.cli.main")

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


#: ``dedup purge`` asks for confirmation (or ``--yes``) below this horizon: redeliveries
#: after an outage and replays of recent history rely on the claims of the last day.
PURGE_CONFIRM_BELOW = timedelta(days=1)
_PURGE_CONFIRM_TEXT = "1d"


class Duration(timedelta):
    """A timedelta that prints as the user wrote it (``7d``, not ``7 days, 0:00:00``)."""

    text: str

    def __str__(self) -> str:
        return self.text


def parse_duration(text: str) -> Duration:
    """``90s``, ``15m``, ``12h``, ``7d``, ``2w`` → a timedelta that prints as given."""
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 90s, 15m, 12h, 7d)")
    duration = Duration(**{_UNITS[match.group(2)]: float(match.group(1))})
    duration.text = text.strip()
    return duration


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON (stable keys, listed in docs/guide.md, JSON output)",
    )


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(exitcodes.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _log_level(text: str) -> str:
    """A logging level name (DEBUG, INFO, WARNING, ERROR, CRITICAL), upper-cased."""
    level = text.strip().upper()
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r} (choose from {', '.join(_LOG_LEVELS)})"
        )
    return level


def _common_options(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    """``--debug``, ``--log-level`` and ``--config``, accepted before and after a command.

    Only the top-level parser holds the defaults: a sub-command's copy is SUPPRESSed when
    absent, so it never overwrites what was given before the command.
    """

    def default(value: Any) -> Any:
        return value if top_level else argparse.SUPPRESS

    parser.add_argument(
        "--debug", action="store_true", default=default(False), help="show tracebacks on errors"
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=default(None),
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL" + env_help("log_level"),
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=default(None),
        help="text (key=value context) or json (one object per line)" + env_help("log_format"),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=default(None),
        help=f"TOML config file (env {CONFIG_ENV})",
    )


def _add_common_options_everywhere(parser: argparse.ArgumentParser) -> None:
    """Give every sub-command (at any depth) the common options."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _common_options(sub, top_level=False)
                _add_common_options_everywhere(sub)


def _database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database", metavar="URL", default=None, help="database URL" + env_help("database_url")
    )
    parser.add_argument(
        "--table-prefix",
        default=None,
        help="prefix of the framework's tables" + env_help("table_prefix"),
    )


def _daemon_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds to drain after a stop signal" + env_help("shutdown_timeout"),
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /healthz and /metrics" + env_help("health_port"),
    )
    parser.add_argument(
        "--health-host",
        metavar="ADDRESS",
        default=None,
        help="address the health endpoint binds" + env_help("health_host"),
    )


def _broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kafka-bootstrap",
        metavar="HOST:PORT[,...]",
        default=None,
        help="Kafka bootstrap servers" + env_help("kafka_bootstrap"),
    )
    parser.add_argument(
        "--rabbitmq-url",
        metavar="URL",
        default=None,
        help="RabbitMQ URL" + env_help("rabbitmq_url"),
    )


def _settings(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """Resolve settings for a command: flag > env > config file > default."""
    file_data = load_file(getattr(args, "config", None))
    flags = {
        "relay_processes": getattr(args, "processes", None),
        "poll_interval": getattr(args, "poll_interval", None),
        "relay_batch_size": getattr(args, "batch_size", None),
        "database_url": getattr(args, "database", None),
        "table_prefix": getattr(args, "table_prefix", None),
        "kafka_bootstrap": getattr(args, "kafka_bootstrap", None),
        "rabbitmq_url": getattr(args, "rabbitmq_url", None),
        "redis_url": getattr(args, "redis_url", None),
        "processes": getattr(args, "processes", None),
        "shutdown_timeout": getattr(args, "shutdown_timeout", None),
        "health_port": getattr(args, "health_port", None),
        "health_host": getattr(args, "health_host", None),
        "log_level": getattr(args, "log_level", None),
        "log_format": getattr(args, "log_format", None),
    }
    wanted = names or ("database_url", "table_prefix")
    settings = {name: resolve(name, flags.get(name), file_data) for name in wanted}
    if "table_prefix" in settings:
        settings["table_prefix"] = _table_prefix(args)[0]
    return settings


def _table_prefix(args: argparse.Namespace) -> tuple[str, str | None]:
    """The configured table prefix, validated, and where it came from (None: default).

    A prefix the tables cannot hold (characters, identifier length) is refused here,
    before anything connects.
    """

    flag = getattr(args, "table_prefix", None)
    file_data = load_file(getattr(args, "config", None))
    prefix, source = resolve_with_source("table_prefix", flag, file_data)
    try:
        schema(prefix)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source or 'default'}: {exc}") from None
    return prefix, source


def _consumer_prefix(args: argparse.Namespace, reference: str, consumer: Any) -> str:
    """Give ``consumer`` the table prefix it runs with (see config.consumer_table_prefix)."""
    configured, source = _table_prefix(args)
    prefix = consumer_table_prefix(type(consumer), configured, source, reference)
    use_table_prefix(consumer, prefix)
    return prefix


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = _Parser(prog="mqdedup", description="Effectively-once Kafka and RabbitMQ consumers.")
    parser.add_argument("--version", action="version", version=f"mqdedup {__version__}")
    _common_options(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="run the effectively-once demo (SQLite + memory)")
    demo.add_argument("--messages", type=int, default=5000, help="unique orders (default 5000)")
    demo.add_argument(
        "--duplicates", type=float, default=0.3, metavar="RATE", help="duplicate rate (0.3)"
    )
    demo.add_argument("--crash-rate", type=float, default=0.05, help="crashes per batch (0.05)")
    demo.add_argument("--seed", type=int, default=7, help="random seed (7)")
    demo.add_argument(
        "--database",
        metavar="URL",
        default=None,
        help="database URL (default: a temporary SQLite file). In that database the demo DROPS "
        "and recreates the table demo_orders and deletes the claims of consumer 'demo-orders'",
    )
    demo.add_argument(
        "--force",
        action="store_true",
        help="with --database: go on even if demo_orders already holds rows",
    )
    demo.set_defaults(run=_cmd_demo)

    db = commands.add_parser("db", help="create, migrate or check the framework's tables")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    for action, help_text, handler in (
        ("init", "create the framework's tables (idempotent)", _cmd_db_init),
        (
            "upgrade",
            "bring the tables to this version (missing tables, indexes, key collations)",
            _cmd_db_init,
        ),
        ("check", "check the live schema against this version", _cmd_db_check),
    ):
        sub = db_commands.add_parser(action, help=help_text)
        _database_option(sub)
        sub.set_defaults(run=handler)

    dedup = commands.add_parser("dedup", help="dedup table retention")
    dedup_commands = dedup.add_subparsers(dest="dedup_command", required=True, metavar="ACTION")
    purge = dedup_commands.add_parser("purge", help="delete old dedup records in chunks")
    _database_option(purge)
    purge.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d")
    purge.add_argument("--consumer", default=None, help="only this consumer name")
    purge.add_argument("--chunk-size", type=int, default=5000, help="rows per transaction")
    purge.add_argument(
        "--dry-run", action="store_true", help="print how many records would be deleted"
    )
    purge.add_argument(
        "--yes",
        action="store_true",
        help=f"no confirmation for --older-than below {_PURGE_CONFIRM_TEXT} (asked on a terminal, "
        "refused otherwise)",
    )
    purge.set_defaults(run=_cmd_dedup_purge)
    stats = dedup_commands.add_parser("stats", help="dedup records per consumer, oldest, size")
    _database_option(stats)
    _json_option(stats)
    stats.set_defaults(run=_cmd_dedup_stats)

    outbox = commands.add_parser("outbox", help="inspect and repair the outbox")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    outbox_status = outbox_commands.add_parser("status", help="pending / failed / published rows")
    _database_option(outbox_status)
    _json_option(outbox_status)
    outbox_status.set_defaults(run=_cmd_outbox_status)
    retry = outbox_commands.add_parser("retry-failed", help="put failed rows back to pending")
    _database_option(retry)
    retry.add_argument("--id", dest="ids", type=int, action="append", help="only this row id")
    retry.add_argument("--destination", default=None, help="only this topic / exchange")
    retry.set_defaults(run=_cmd_outbox_retry)
    outbox_purge = outbox_commands.add_parser("purge", help="delete old published rows in chunks")
    _database_option(outbox_purge)
    outbox_purge.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d")
    outbox_purge.add_argument("--chunk-size", type=int, default=5000, help="rows per transaction")
    outbox_purge.add_argument(
        "--dry-run", action="store_true", help="print how many rows would be deleted"
    )
    outbox_purge.set_defaults(run=_cmd_outbox_purge)

    dead = commands.add_parser(
        "dead-letters", help="dead letters the broker refused, kept in the database"
    )
    dead_commands = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    dead_list = dead_commands.add_parser("list", help="kept dead letters, oldest first")
    _database_option(dead_list)
    dead_list.add_argument("--consumer", default=None, help="only this consumer name")
    dead_list.add_argument("--limit", type=int, default=100, help="at most N rows (default 100)")
    dead_list.set_defaults(run=_cmd_dead_letters_list)
    dead_replay = dead_commands.add_parser(
        "replay", help="run the consumer over its kept dead letters again (after a fix)"
    )
    dead_replay.add_argument("consumer", help="module.path:ConsumerClass")
    dead_replay.add_argument("--id", dest="ids", type=int, action="append", help="only this row")
    _database_option(dead_replay)
    _broker_options(dead_replay)
    dead_replay.set_defaults(run=_cmd_dead_letters_replay)
    dead_delete = dead_commands.add_parser("delete", help="delete kept dead letters")
    _database_option(dead_delete)
    dead_delete.add_argument("--consumer", required=True, help="the consumer name")
    dead_delete.add_argument("--id", dest="ids", type=int, action="append", help="this row")
    dead_delete.add_argument("--all", action="store_true", help="every row of the consumer")
    dead_delete.set_defaults(run=_cmd_dead_letters_delete)

    relay = commands.add_parser("relay", help="publish committed outbox rows (a daemon)")
    _database_option(relay)
    _broker_options(relay)
    relay.add_argument(
        "--processes", type=int, default=None, help="relay processes" + env_help("relay_processes")
    )
    relay.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        help="seconds between polls without NOTIFY" + env_help("poll_interval"),
    )
    relay.add_argument(
        "--batch-size", type=int, default=None, help="rows per claim" + env_help("relay_batch_size")
    )
    _daemon_options(relay)
    relay.set_defaults(run=_cmd_relay)

    replay = commands.add_parser(
        "replay",
        help="run a consumer again over a past range (Kafka) or its dead letters (RabbitMQ)",
        description="Already processed messages are skipped as duplicates; the live "
        "consumer group's offsets are not touched.",
    )
    replay.add_argument("consumer", help="module.path:ConsumerClass")
    replay.add_argument(
        "--from",
        dest="start",
        default="beginning",
        help="offset, ISO time (UTC unless a zone is given) or 'beginning' (default)",
    )
    replay.add_argument(
        "--to", dest="end", default="end", help="offset, ISO time or 'end' (default; exclusive)"
    )
    replay.add_argument(
        "--partition", dest="partitions", type=int, action="append", help="only this partition"
    )
    replay.add_argument(
        "--dry-run", action="store_true", help="count new / duplicate / id-less, write nothing"
    )
    replay.add_argument(
        "--allow-reprocess",
        action="store_true",
        help="replay even before the dedup retention horizon (purged ids are applied again)",
    )
    replay.add_argument(
        "--from-dlq", action="store_true", help="RabbitMQ: move dead letters back to the queue"
    )
    replay.add_argument("--limit", type=int, default=None, help="with --from-dlq: at most N")
    replay.add_argument(
        "--stream",
        default=None,
        help="RabbitMQ: the stream queue to replay (default: the consumer's queue)",
    )
    _database_option(replay)
    _broker_options(replay)
    replay.set_defaults(run=_cmd_replay)

    status = commands.add_parser(
        "status", help="one screen: consumers' lag, dedup table, outbox backlog"
    )
    status.add_argument(
        "consumers", nargs="*", metavar="CONSUMER", help="module.path:ConsumerClass to show lag for"
    )
    _database_option(status)
    _broker_options(status)
    _json_option(status)
    status.set_defaults(run=_cmd_status)

    worker = commands.add_parser(
        "worker", help="run consumers in supervised worker processes until SIGTERM/SIGINT"
    )
    worker.add_argument(
        "consumers",
        nargs="+",
        metavar="CONSUMER",
        help="module.path:ConsumerClass (a Consumer subclass)",
    )
    _database_option(worker)
    _broker_options(worker)
    worker.add_argument(
        "--redis-url",
        metavar="URL",
        default=None,
        help="Redis for consumers with dedup = RedisDedup(...)" + env_help("redis_url"),
    )
    worker.add_argument(
        "--processes", type=int, default=None, help="processes per consumer" + env_help("processes")
    )
    _daemon_options(worker)
    worker.set_defaults(run=_cmd_worker)
    _add_common_options_everywhere(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        _configure_logging(args)
        return run(args)
    except MqdedupError as exc:
        if args.debug:
            log.exception("failed")
        print(f"mqdedup: error: {mask_text(str(exc))}", file=sys.stderr)
        return exitcodes.exit_code_for(exc)
    except KeyboardInterrupt:
        print("mqdedup: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


def _configure_logging(args: argparse.Namespace) -> None:
    """Log level and format: flag > ``MQDEDUP_LOG_LEVEL`` / ``_FORMAT`` > TOML > default.

    The resolved values are written back to ``args`` so worker children get the same.
    """
    settings = _settings(args, "log_level", "log_format")
    try:
        args.log_level = _log_level(str(settings["log_level"]))
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(str(exc)) from None
    args.log_format = str(settings["log_format"])
    if args.log_format not in ("text", "json"):
        raise ConfigurationError(f"unknown log format {args.log_format!r} (choose text or json)")
    configure_logging(args.log_level, args.log_format)


def _engine(args: argparse.Namespace, *, require_schema: bool = True) -> tuple[Engine, str]:
    """A connected engine for the command's database, and the table prefix."""
    settings = _settings(args)
    engine = create_engine(settings["database_url"])
    check_connection(engine)
    if require_schema:
        _require_schema(engine, settings["table_prefix"])
    return engine, settings["table_prefix"]


def _require_schema(engine: Engine, prefix: str) -> None:
    problems = check_schema(engine, prefix)
    if problems:
        raise ConfigurationError(f"the database does not match this mqdedup version: {problems[0]}")


def _cmd_demo(args: argparse.Namespace) -> int:
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


def _cmd_db_init(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args, require_schema=False)
    created = init_schema(engine, prefix)
    changed = upgrade_schema(engine, prefix)
    if created:
        print(f"created: {', '.join(created)}")
    for change in changed:
        print(change)
    if not (created or changed):
        print("schema is up to date")
    return exitcodes.OK


def _cmd_db_check(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args, require_schema=False)
    problems = check_schema(engine, prefix) + [str(d) for d in schema_drift(engine, prefix)]
    for problem in problems:
        print(problem)
    if not problems:
        print("schema matches this version")
    return exitcodes.CHECK_FAILED if problems else exitcodes.OK


def _cmd_dedup_purge(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args)
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
        f"--older-than {older_than} is below {_PURGE_CONFIRM_TEXT}: redeliveries and replays "
        f"of messages newer than {_PURGE_CONFIRM_TEXT} rely on these claims{scope}"
    )
    if not sys.stdin.isatty():
        raise RefusedError(f"{risk}; nothing deleted (pass --yes to confirm, --dry-run to count)")
    answer = input(f"{risk}. Delete them? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise RefusedError("not confirmed; nothing deleted")


def _cmd_dedup_stats(args: argparse.Namespace) -> int:
    stats = dedup_stats(*_engine(args))
    if args.json:
        _print_json(dedup_stats_data(*stats))
    else:
        print(format_dedup_stats(*stats))
    return exitcodes.OK


def _cmd_outbox_status(args: argparse.Namespace) -> int:
    if args.json:
        _print_json(outbox_status_data(*_engine(args)))
    else:
        print(format_outbox_status(*_engine(args)))
    return exitcodes.OK


def _cmd_outbox_retry(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args)
    count = OutboxStore(prefix).retry_failed(engine, ids=args.ids, destination=args.destination)
    print(f"{count} failed outbox row(s) back to pending")
    return exitcodes.OK


def _cmd_outbox_purge(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args)
    if args.dry_run:
        count = count_purgeable_outbox_rows(engine, prefix, args.older_than)
        print(
            f"would delete {count} published outbox row(s) older than {args.older_than} (dry run)"
        )
        return exitcodes.OK
    count = OutboxStore(prefix).purge(engine, args.older_than, chunk_size=args.chunk_size)
    print(f"deleted {count} published outbox row(s) older than {args.older_than}")
    return exitcodes.OK


def _cmd_dead_letters_list(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args)
    print(list_dead_letters(engine, prefix, args.consumer, args.limit))
    return exitcodes.OK


def _cmd_dead_letters_replay(args: argparse.Namespace) -> int:
    settings = _settings(args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url")
    _export_environment(settings)
    consumer = create_consumer(args.consumer)
    consumer.validate()
    engine, _ = _engine(args, require_schema=False)
    _require_schema(engine, consumer.table_prefix)
    stop = StopToken()
    try:
        with graceful_signals(stop):
            outcome = replay_dead_letters(consumer, engine, ids=args.ids, stop=stop)
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    print(outcome)
    return exitcodes.OK


def _cmd_dead_letters_delete(args: argparse.Namespace) -> int:
    engine, prefix = _engine(args)
    count = delete_dead_letters(engine, prefix, args.consumer, args.ids, args.all)
    print(f"deleted {count} kept dead letter(s) of {args.consumer}")
    return exitcodes.OK


def _cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url")
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    prefixes = {
        _consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
    }
    engine, prefix = _engine(args, require_schema=False)
    if len(prefixes) == 1:  # the consumers' own tables, when they all agree
        prefix = prefixes.pop()
    _require_schema(engine, prefix)
    data = status_data(engine, prefix, consumers)
    if args.json:
        _print_json(data)
    else:
        print(status_screen(data))
    unreachable = [e for e in data["consumers"] if e["unreachable"]]
    if unreachable:  # the screen is printed; the exit code and one line say what is missing
        names = ", ".join(sorted({e["consumer"] for e in unreachable}))
        print(f"mqdedup: error: {unreachable[0]['error']} (lag unknown: {names})", file=sys.stderr)
        return exitcodes.BROKER_UNAVAILABLE
    return exitcodes.OK


def _cmd_replay(args: argparse.Namespace) -> int:
    settings = _settings(args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url")
    _export_environment(settings)
    start = parse_position(args.start)
    end = parse_position(args.end, end=True)
    consumer = create_consumer(args.consumer)
    _consumer_prefix(args, args.consumer, consumer)
    consumer.validate()
    engine, _ = _engine(args, require_schema=False)
    _require_schema(engine, consumer.table_prefix)
    kind = _broker_kind(consumer)
    if args.from_dlq:
        if kind != "rabbitmq":
            raise ConfigurationError("--from-dlq is for RabbitMQ consumers")
        _connect_broker(consumer)
        print(requeue_from_dlq(consumer, engine, args.limit))
        return exitcodes.OK
    if kind is None:
        raise ConfigurationError(
            f"{args.consumer} is neither a KafkaConsumer nor a RabbitMQConsumer: "
            "replay needs a broker to read from"
        )
    _connect_broker(consumer)
    stop = StopToken()
    try:
        with graceful_signals(stop):
            if kind == "kafka":
                report = replay_kafka(
                    consumer,
                    engine,
                    start=start,
                    end=end,
                    partitions=args.partitions,
                    dry_run=args.dry_run,
                    allow_reprocess=args.allow_reprocess,
                    stop=stop,
                    progress=sys.stderr,
                )
            else:
                report = replay_stream(
                    consumer,
                    engine,
                    start=start,
                    end=end,
                    stream=args.stream,
                    dry_run=args.dry_run,
                    allow_reprocess=args.allow_reprocess,
                    stop=stop,
                )
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    print(format_replay_report(report))
    return exitcodes.OK


def _connect_broker(consumer: Any) -> None:
    """Wait for the consumer's broker up to its start-up timeout, then check it once.

    Kafka and RabbitMQ behave the same: an unreachable broker is awaited (one line says
    so) for ``connect_timeout`` / ``startup_timeout`` seconds, then the command exits
    with BROKER_UNAVAILABLE; a broker that answers but refuses (login, topology) fails
    at once with the consumer's own check.
    """

    wait_for_consumer_broker(consumer, lambda line: print(f"mqdedup: {line}", file=sys.stderr))
    consumer.check_connection()


def _broker_kind(consumer: Consumer) -> str | None:
    for module, name, kind in (
        ("mqdedup.kafka.consumer", "KafkaConsumer", "kafka"),
        ("mqdedup.rabbitmq.consumer", "RabbitMQConsumer", "rabbitmq"),
    ):
        try:
            base = getattr(importlib.import_module(module), name)
        except ImportError:
            continue
        if isinstance(consumer, base):
            return kind
    return None


def _cmd_relay(args: argparse.Namespace) -> int:
    settings = _settings(
        args,
        "database_url",
        "table_prefix",
        "kafka_bootstrap",
        "rabbitmq_url",
        "relay_processes",
        "poll_interval",
        "relay_batch_size",
        "shutdown_timeout",
        "health_port",
        "health_host",
    )
    if settings["relay_processes"] < 1:
        raise ConfigurationError("--processes must be at least 1")
    engine = create_engine(settings["database_url"])
    check_connection(engine)
    _require_schema(engine, settings["table_prefix"])
    engine.dispose()
    for publisher in create_publishers(
        kafka_bootstrap=settings["kafka_bootstrap"], rabbitmq_url=settings["rabbitmq_url"]
    ).values():
        publisher.close()  # validates the configuration; connections open lazily
    check_relay_brokers(settings["kafka_bootstrap"], settings["rabbitmq_url"])
    specs = [
        ChildSpec(
            name="relay",
            index=index,
            runner="mqdedup.cli.runners:run_relay",
            options=settings,
            log_level=args.log_level,
            log_format=args.log_format,
        )
        for index in range(settings["relay_processes"])
    ]
    return _supervise(specs, settings)


def _supervise(
    specs: list[Any],
    settings: dict[str, Any],
    *,
    outbox_gauges: bool = True,
    prefix: str | None = None,
) -> int:
    """Run ``specs`` under a supervisor with the health endpoint; return its exit code.

    ``outbox_gauges``: report the outbox backlog on /metrics (not for Redis-only workers,
    which have no database). ``prefix``: the outbox's table prefix (default: the setting).
    """

    gauges = OutboxGauges(settings["database_url"], prefix or settings["table_prefix"])
    supervisor = Supervisor(
        specs,
        shutdown_timeout=settings["shutdown_timeout"],
        health_port=settings["health_port"],
        health_host=settings["health_host"],
        shared_metrics=gauges if outbox_gauges else None,
    )
    return supervisor.run()


def _cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings(
        args,
        "database_url",
        "table_prefix",
        "kafka_bootstrap",
        "rabbitmq_url",
        "redis_url",
        "processes",
        "shutdown_timeout",
        "health_port",
        "health_host",
    )
    if settings["processes"] < 1:
        raise ConfigurationError("--processes must be at least 1")
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    # Consumers whose claims live outside the database (RedisDedup) need none.
    database_consumers = [c for c in consumers if c.dedup.needs_database]
    prefixes = {
        reference: _consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
        if consumer.dedup.needs_database
    }
    for consumer in consumers:
        consumer.validate()
        consumer.dedup.check()  # e.g. Redis unreachable: one line, exit code 5
    if database_consumers:
        engine = create_engine(settings["database_url"])
        check_connection(engine)
        for database_consumer in database_consumers:
            _require_schema(engine, database_consumer.table_prefix)
        engine.dispose()
    for consumer in consumers:
        _connect_broker(consumer)
    specs = [
        ChildSpec(
            name=consumer.consumer_name,
            index=index,
            runner="mqdedup.cli.runners:run_consumer",
            options={
                "consumer": reference,
                **settings,
                "table_prefix": prefixes.get(reference, settings["table_prefix"]),
            },
            log_level=args.log_level,
            log_format=args.log_format,
        )
        for reference, consumer in zip(args.consumers, consumers, strict=True)
        for index in range(settings["processes"])
    ]
    shared = set(prefixes.values())
    return _supervise(
        specs,
        settings,
        outbox_gauges=bool(database_consumers),
        prefix=shared.pop() if len(shared) == 1 else None,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
