"""The grammar of the ``mqdedup`` command: every sub-command with its options and the
function that runs it (:func:`build_parser`), the options several sub-commands share,
and how values are read (durations, log levels) and usage errors reported (one line, exit
code 2)."""

from __future__ import annotations

import argparse
import re
from datetime import timedelta
from typing import Any

from mqdedup import __version__
from mqdedup.cli import exitcodes
from mqdedup.cli.admin import (
    PURGE_CONFIRM_TEXT,
    cmd_db_check,
    cmd_db_init,
    cmd_dedup_purge,
    cmd_dedup_stats,
    cmd_outbox_purge,
    cmd_outbox_retry,
    cmd_outbox_status,
)
from mqdedup.cli.claims import cmd_dedup_forget, cmd_dedup_show
from mqdedup.cli.config import CONFIG_ENV, env_help
from mqdedup.cli.console import DEFAULT_PORT, cmd_console
from mqdedup.cli.daemons import cmd_relay, cmd_worker
from mqdedup.cli.dead_letters import (
    cmd_dead_letters_delete,
    cmd_dead_letters_list,
    cmd_dead_letters_replay,
    cmd_dead_letters_requeue,
    cmd_dead_letters_show,
)
from mqdedup.cli.demo import cmd_demo
from mqdedup.cli.help_texts import apply_help
from mqdedup.cli.publish import add_publish_parser  # typed43
from mqdedup.cli.replay import cmd_replay
from mqdedup.cli.status import cmd_status

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: The longest duration accepted: a horizon this far back is still a date.
MAX_DURATION = timedelta(days=36_500)
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = Parser(prog="mqdedup", description="Effectively-once Kafka and RabbitMQ consumers.")
    parser.add_argument("--version", action="version", version=f"mqdedup {__version__}")
    common_options(parser, top_level=True)
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
    demo.set_defaults(run=cmd_demo)

    db = commands.add_parser("db", help="create, migrate or check the framework's tables")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    for action, help_text, handler in (
        ("init", "create the framework's tables (idempotent)", cmd_db_init),
        (
            "upgrade",
            "bring the tables to this version (missing tables, indexes, key collations)",
            cmd_db_init,
        ),
        ("check", "check the live schema against this version", cmd_db_check),
    ):
        sub = db_commands.add_parser(action, help=help_text)
        database_option(sub)
        sub.set_defaults(run=handler)

    dedup = commands.add_parser("dedup", help="dedup table retention")
    dedup_commands = dedup.add_subparsers(dest="dedup_command", required=True, metavar="ACTION")
    purge = dedup_commands.add_parser("purge", help="delete old dedup records in chunks")
    database_option(purge)
    purge.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d")
    purge.add_argument("--consumer", default=None, help="only this consumer name")
    purge.add_argument("--chunk-size", type=positive_int, default=5000, help="rows per transaction")
    purge.add_argument(
        "--dry-run", action="store_true", help="print how many records would be deleted"
    )
    purge.add_argument(
        "--yes",
        action="store_true",
        help=f"no confirmation for --older-than below {PURGE_CONFIRM_TEXT} (asked on a terminal, "
        "refused otherwise)",
    )
    quiet_option(purge, "the progress line")
    purge.set_defaults(run=cmd_dedup_purge)
    stats = dedup_commands.add_parser("stats", help="dedup records per consumer, oldest, size")
    database_option(stats)
    json_option(stats)
    stats.set_defaults(run=cmd_dedup_stats)
    dedup_show = dedup_commands.add_parser(
        "show", help="one message id's claim: stored result, processed at, steps"
    )
    dedup_show.add_argument("message_id", metavar="MESSAGE_ID")
    dedup_show.add_argument("--consumer", default=None, help="only this consumer name")
    database_option(dedup_show)
    json_option(dedup_show)
    dedup_show.set_defaults(run=cmd_dedup_show)
    dedup_forget = dedup_commands.add_parser(
        "forget",
        help="delete one message id's claim (and steps): its next delivery runs the handler",
    )
    dedup_forget.add_argument("message_id", metavar="MESSAGE_ID")
    dedup_forget.add_argument("--consumer", required=True, help="the consumer name")
    dedup_forget.add_argument(
        "--yes",
        action="store_true",
        help="no confirmation (asked on a terminal, refused otherwise)",
    )
    database_option(dedup_forget)
    dedup_forget.set_defaults(run=cmd_dedup_forget)

    outbox = commands.add_parser("outbox", help="inspect and repair the outbox")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    outbox_status = outbox_commands.add_parser("status", help="pending / failed / published rows")
    database_option(outbox_status)
    json_option(outbox_status)
    outbox_status.set_defaults(run=cmd_outbox_status)
    retry = outbox_commands.add_parser("retry-failed", help="put failed rows back to pending")
    database_option(retry)
    retry.add_argument("--id", dest="ids", type=int, action="append", help="only this row id")
    retry.add_argument("--destination", default=None, help="only this topic / exchange")
    retry.set_defaults(run=cmd_outbox_retry)
    outbox_purge = outbox_commands.add_parser("purge", help="delete old published rows in chunks")
    database_option(outbox_purge)
    outbox_purge.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d")
    outbox_purge.add_argument(
        "--chunk-size", type=positive_int, default=5000, help="rows per transaction"
    )
    outbox_purge.add_argument(
        "--dry-run", action="store_true", help="print how many rows would be deleted"
    )
    outbox_purge.set_defaults(run=cmd_outbox_purge)

    dead = commands.add_parser(
        "dead-letters",
        help="list, show, replay, requeue or delete dead letters (database, Kafka DLTs, "
        "RabbitMQ DLQs)",
        description="Dead letters are kept in three places: the database (those the broker "
        "refused; the default), Kafka dead-letter topics (--place kafka or --topic) and "
        "RabbitMQ dead-letter queues (--place rabbitmq or --queue). A replay goes through "
        "the consumer's claims: replaying twice runs each message's effects once.",
    )
    dead_commands = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    dead_list = dead_commands.add_parser("list", help="dead letters, oldest first")
    _dead_letter_place_options(dead_list)
    dead_list.add_argument("--consumer", default=None, help="only this consumer name")
    dead_list.add_argument("--limit", type=int, default=100, help="at most N (default 100)")
    dead_list.add_argument(
        "--groups", action="store_true", help="one line per consumer and error, with counts"
    )
    json_option(dead_list)
    dead_list.set_defaults(run=cmd_dead_letters_list)
    dead_show = dead_commands.add_parser(
        "show", help="one dead letter: reason, attempts, headers, body (size-limited)"
    )
    dead_show.add_argument("key", help="its key, as `list` prints it")
    _dead_letter_place_options(dead_show)
    dead_show.add_argument(
        "--body-limit",
        type=int,
        default=4096,
        metavar="BYTES",
        help="show at most this much of the body (default 4096)",
    )
    json_option(dead_show)
    dead_show.set_defaults(run=cmd_dead_letters_show)
    dead_replay = dead_commands.add_parser(
        "replay",
        help="run the consumer over its dead letters again (after a fix), through its claims",
    )
    dead_replay.add_argument("consumer", help="module.path:ConsumerClass")
    _dead_letter_place_options(dead_replay)
    _dead_letter_choice_options(dead_replay, everything=False)
    dead_replay.set_defaults(run=cmd_dead_letters_replay)
    dead_requeue = dead_commands.add_parser(
        "requeue", help="send dead letters back to their source topic / queue (same message id)"
    )
    _dead_letter_place_options(dead_requeue)
    dead_requeue.add_argument("--consumer", default=None, help="only this consumer name")
    _dead_letter_choice_options(dead_requeue)
    dead_requeue.set_defaults(run=cmd_dead_letters_requeue)
    dead_delete = dead_commands.add_parser("delete", help="drop dead letters for good")
    _dead_letter_place_options(dead_delete)
    dead_delete.add_argument("--consumer", default=None, help="only this consumer name")
    _dead_letter_choice_options(dead_delete)
    dead_delete.set_defaults(run=cmd_dead_letters_delete)

    add_publish_parser(commands)  # typed43: mqdedup publish (mqdedup/cli/publish.py)

    relay = commands.add_parser("relay", help="publish committed outbox rows (a daemon)")
    database_option(relay)
    broker_options(relay)
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
    relay.add_argument(
        "--keep-published",
        action="store_true",
        default=None,
        help="mark published rows and keep them (purged after 7 days) instead of deleting "
        "them; status counts them either way" + env_help("relay_keep_published"),
    )
    relay.add_argument(
        "--control-database",
        metavar="URL",
        default=None,
        help="a direct (or session-pooled) URL of the same database for the relays' shard "
        "locks and LISTEN, when --database goes through a transaction pooler such as PgBouncer"
        + env_help("control_database_url"),
    )
    relay.add_argument(
        "--coordination",
        choices=("session", "transaction"),
        default=None,
        help="session: shard locks and LISTEN on a control connection; transaction: no "
        "session state (relays take turns under a transaction-level lock, polling), for a "
        "database reached only through a transaction pooler" + env_help("relay_coordination"),
    )
    relay.add_argument(
        "--drain",
        action="store_true",
        help="publish what is due now, in this process, then exit: 0 when every row was "
        f"published, {exitcodes.NOT_DRAINED} when the broker refused rows or stayed "
        "unavailable until --drain-timeout",
    )
    relay.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="with --drain: give up after this long (default 60)",
    )
    daemon_options(relay)
    quiet_option(relay, "the start and stop lines")
    relay.set_defaults(run=cmd_relay)

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
        "--partition",
        dest="partitions",
        type=non_negative_int,
        action="append",
        help="only this partition",
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
    replay.add_argument(
        "--limit", type=positive_int, default=None, help="with --from-dlq: at most N"
    )
    replay.add_argument(
        "--stream",
        default=None,
        help="RabbitMQ: the stream queue to replay (default: the consumer's queue)",
    )
    database_option(replay)
    broker_options(replay)
    quiet_option(replay, "the progress line")
    replay.set_defaults(run=cmd_replay)

    status = commands.add_parser(
        "status", help="one screen: consumers' lag, dedup table, outbox backlog"
    )
    status.add_argument(
        "consumers", nargs="*", metavar="CONSUMER", help="module.path:ConsumerClass to show lag for"
    )
    database_option(status)
    broker_options(status)
    json_option(status)
    status.set_defaults(run=cmd_status)

    console_command(commands)

    worker = commands.add_parser(
        "worker", help="run consumers in supervised worker processes until SIGTERM/SIGINT"
    )
    worker.add_argument(
        "consumers",
        nargs="+",
        metavar="CONSUMER",
        help="module.path:ConsumerClass (a Consumer subclass)",
    )
    database_option(worker)
    broker_options(worker)
    worker.add_argument(
        "--redis-url",
        metavar="URL",
        default=None,
        help="Redis for consumers with dedup = RedisDedup(...)" + env_help("redis_url"),
    )
    worker.add_argument(
        "--processes", type=int, default=None, help="processes per consumer" + env_help("processes")
    )
    daemon_options(worker)
    quiet_option(worker, "the start and stop lines")
    worker.set_defaults(run=cmd_worker)
    add_common_options_everywhere(parser)
    apply_help(parser)
    return parser


def console_command(commands: Any) -> None:
    """``mqdedup console``: the operator's web console."""
    console = commands.add_parser(
        "console",
        help="serve the operator's web console (overview, dead letters, claims, outbox)",
        description="Server-rendered pages on 127.0.0.1 unless --host says otherwise; bound "
        "elsewhere it needs --token or --basic-auth. Example: mqdedup console "
        "shop.consumers:Orders --database postgresql://app@db/app --port 8470",
    )
    console.add_argument(
        "consumers",
        nargs="*",
        metavar="CONSUMER",
        help="module.path:ConsumerClass the console may replay dead letters through",
    )
    console.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    console.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port ({DEFAULT_PORT})")
    console.add_argument(
        "--token", default=None, help="access token to sign in with (env MQDEDUP_CONSOLE_TOKEN)"
    )
    console.add_argument(
        "--basic-auth",
        metavar="USER:PASSWORD",
        default=None,
        help="basic-auth credentials (env MQDEDUP_CONSOLE_BASIC_AUTH)",
    )
    console.add_argument(
        "--read-only", action="store_true", help="show no action and refuse every POST"
    )
    console.add_argument(
        "--body-limit",
        type=int,
        default=64 * 1024,
        metavar="BYTES",
        help="most bytes of a message body shown (65536); longer bodies are truncated",
    )
    console.add_argument(
        "--hours", type=float, default=3.0, help="how far back the overview's charts reach (3)"
    )
    console.add_argument(
        "--metrics",
        metavar="URL",
        action="append",
        default=[],
        help="a worker supervisor's /metrics (repeatable): duplicates per minute, sampled "
        "each minute from the console's start",
    )
    database_option(console)
    broker_options(console)
    console.set_defaults(run=cmd_console)


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
    try:
        duration = Duration(**{_UNITS[match.group(2)]: float(match.group(1))})
    except OverflowError:
        duration = None
    if duration is None or duration > MAX_DURATION:
        raise argparse.ArgumentTypeError(
            f"duration {text.strip()!r} is too long (at most {MAX_DURATION.days}d, 100 years)"
        )
    duration.text = text.strip()
    return duration


def positive_int(text: str) -> int:
    """An integer of at least 1 (rows per chunk, a limit)."""
    value: int = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text.strip()!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (a partition)."""
    value: int = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text.strip()!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number of seconds above 0."""
    value: float = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text!r}")
    return value


def _number(text: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, not {text.strip()!r}") from None


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(exitcodes.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_log_level(text: str) -> str:
    """A logging level name (DEBUG, INFO, WARNING, ERROR, CRITICAL), upper-cased."""
    level = text.strip().upper()
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r} (choose from {', '.join(_LOG_LEVELS)})"
        )
    return level


def common_options(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
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
        type=parse_log_level,
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


def add_common_options_everywhere(parser: argparse.ArgumentParser) -> None:
    """Give every sub-command (at any depth) the common options."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                common_options(sub, top_level=False)
                add_common_options_everywhere(sub)


def database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database", metavar="URL", default=None, help="database URL" + env_help("database_url")
    )
    parser.add_argument(
        "--table-prefix",
        default=None,
        help="prefix of the framework's tables" + env_help("table_prefix"),
    )


def daemon_options(parser: argparse.ArgumentParser) -> None:
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


def broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kafka-bootstrap",
        metavar="HOST:PORT[,...]",
        default=None,
        help="Kafka bootstrap servers" + env_help("kafka_bootstrap"),
    )
    parser.add_argument(
        "--rabbitmq-url",
        metavar="URL[,URL...]",
        default=None,
        help="RabbitMQ URL (a cluster: its nodes' URLs, comma-separated)"
        + env_help("rabbitmq_url"),
    )


def _dead_letter_place_options(parser: argparse.ArgumentParser) -> None:
    """Where the dead letters are: ``--place``, ``--topic``, ``--queue`` (and the
    database and broker settings)."""
    parser.add_argument(
        "--place",
        choices=("database", "kafka", "rabbitmq"),
        default=None,
        help="database (kept because the broker refused them; the default), kafka or rabbitmq",
    )
    parser.add_argument(
        "--topic",
        dest="topics",
        action="append",
        metavar="TOPIC",
        help="a Kafka dead-letter topic (default: every *.DLT topic; replay: the consumer's)",
    )
    parser.add_argument(
        "--queue",
        dest="queues",
        action="append",
        metavar="QUEUE",
        help="a RabbitMQ dead-letter queue (replay: default the consumer's)",
    )
    database_option(parser)
    broker_options(parser)


def _dead_letter_choice_options(
    parser: argparse.ArgumentParser, *, everything: bool = True
) -> None:
    """Which dead letters an action takes: ``--key`` / ``--id``, ``--error``, ``--all``."""
    parser.add_argument(
        "--key", dest="keys", action="append", metavar="KEY", help="this dead letter (repeatable)"
    )
    parser.add_argument(
        "--id", dest="ids", type=int, action="append", help="database place: this row id"
    )
    parser.add_argument(
        "--error", default=None, metavar="TEXT", help="every dead letter of this group (its error)"
    )
    if everything:
        parser.add_argument("--all", action="store_true", help="every dead letter (of --consumer)")


def quiet_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "-q", "--quiet", action="store_true", help=f"leave out {what} (errors still print)"
    )


def json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON (stable keys, listed in docs/running.md, JSON output)",
    )
