"""The ``mqdedup`` command.

User mistakes end with one line on stderr and a documented exit code
(:mod:`mqdedup.exitcodes`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

from mqdedup import exitcodes
from mqdedup.db import (
    DATABASE_URL_ENV,
    check_connection,
    check_schema,
    create_engine,
    database_url_from_env,
    init_schema,
)
from mqdedup.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConsumerImportError,
    DatabaseUnavailableError,
    MqdedupError,
)
from mqdedup.logs import configure as configure_logging
from mqdedup.schema import DEFAULT_PREFIX

log = logging.getLogger("mqdedup.cli")

_EXIT_CODES: dict[type[MqdedupError], int] = {
    ConfigurationError: exitcodes.CONFIGURATION,
    ConsumerImportError: exitcodes.CONSUMER_IMPORT,
    DatabaseUnavailableError: exitcodes.DATABASE_UNAVAILABLE,
    BrokerUnavailableError: exitcodes.BROKER_UNAVAILABLE,
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``7d``, ``2w`` → timedelta."""
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 90s, 15m, 12h, 7d)")
    return timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})


def _database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database",
        metavar="URL",
        default=None,
        help=f"database URL (env {DATABASE_URL_ENV}; default sqlite:///mqdedup.db)",
    )
    parser.add_argument(
        "--table-prefix",
        default=DEFAULT_PREFIX,
        help=f"prefix of the framework's tables (default {DEFAULT_PREFIX})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(
        prog="mqdedup", description="Effectively-once Kafka and RabbitMQ consumers."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--log-level", default="WARNING", help="log level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="run the effectively-once demo (SQLite + memory)")
    demo.add_argument("--messages", type=int, default=5000, help="unique orders (default 5000)")
    demo.add_argument(
        "--duplicates", type=float, default=0.3, metavar="RATE", help="duplicate rate (0.3)"
    )
    demo.add_argument("--crash-rate", type=float, default=0.05, help="crashes per batch (0.05)")
    demo.add_argument("--seed", type=int, default=7, help="random seed (7)")
    demo.add_argument(
        "--database", metavar="URL", default=None, help="database URL (default: a temp SQLite file)"
    )
    demo.set_defaults(run=_cmd_demo)

    db = commands.add_parser("db", help="create, migrate or check the framework's tables")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    for action, help_text, handler in (
        ("init", "create the framework's tables (idempotent)", _cmd_db_init),
        ("upgrade", "bring the tables to this version (creates what is missing)", _cmd_db_init),
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
    purge.set_defaults(run=_cmd_dedup_purge)

    worker = commands.add_parser("worker", help="run consumers")
    worker.add_argument("consumer", help="module.path:ConsumerClass")
    _database_option(worker)
    worker.set_defaults(run=_cmd_worker)
    return parser


def exit_code_for(error: MqdedupError) -> int:
    """The documented exit code of an error (see :mod:`mqdedup.exitcodes`)."""
    return next(
        (code for kind, code in _EXIT_CODES.items() if isinstance(error, kind)),
        exitcodes.CONFIGURATION,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except MqdedupError as exc:
        if args.debug:
            log.exception("failed")
        print(f"mqdedup: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print("mqdedup: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


def _engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    engine = create_engine(args.database or database_url_from_env())
    check_connection(engine)
    return engine


def _cmd_demo(args: argparse.Namespace) -> int:
    from mqdedup.demo import format_summary, run_demo

    if args.messages < 1:
        raise ConfigurationError("--messages must be at least 1")
    if not 0 <= args.duplicates <= 1 or not 0 <= args.crash_rate < 1:
        raise ConfigurationError("--duplicates must be in [0, 1] and --crash-rate in [0, 1)")
    if args.database:
        check_connection(create_engine(args.database))
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
    engine = _engine(args)
    created = init_schema(engine, args.table_prefix)
    print(f"created: {', '.join(created)}" if created else "schema is up to date")
    return exitcodes.OK


def _cmd_db_check(args: argparse.Namespace) -> int:
    problems = check_schema(_engine(args), args.table_prefix)
    for problem in problems:
        print(problem)
    if not problems:
        print("schema matches this version")
    return exitcodes.CHECK_FAILED if problems else exitcodes.OK


def _cmd_dedup_purge(args: argparse.Namespace) -> int:
    from mqdedup.dedup.store import DedupStore

    deleted = DedupStore(args.table_prefix).purge(
        _engine(args), args.older_than, consumer=args.consumer, chunk_size=args.chunk_size
    )
    print(f"deleted {deleted} dedup records older than {args.older_than}")
    return exitcodes.OK


def _cmd_worker(args: argparse.Namespace) -> int:
    from mqdedup.consumers.stopping import ImmediateStop, StopToken, graceful_signals
    from mqdedup.loading import load_consumer_class

    consumer = load_consumer_class(args.consumer)()
    consumer.validate()
    engine = _engine(args)
    stop = StopToken()
    try:
        with graceful_signals(stop):
            consumer.run(engine, stop=stop)
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    return exitcodes.OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
