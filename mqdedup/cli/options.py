"""Shared option definitions and settings resolution of the ``mqdedup`` command."""

from __future__ import annotations

import argparse
import json
import re
from datetime import timedelta
from typing import Any

from mqdedup.cli import exitcodes
from mqdedup.cli.config import (
    CONFIG_ENV,
    consumer_table_prefix,
    env_help,
    load_file,
    resolve,
    resolve_with_source,
    use_table_prefix,
)
from mqdedup.db.schema import schema
from mqdedup.errors import (
    ConfigurationError,
)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


#: ``dedup purge`` asks for confirmation (or ``--yes``) below this horizon: redeliveries
#: after an outage and replays of recent history rely on the claims of the last day.
PURGE_CONFIRM_BELOW = timedelta(days=1)
PURGE_CONFIRM_TEXT = "1d"


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


def json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON (stable keys, listed in docs/guide.md, JSON output)",
    )


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


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
        metavar="URL",
        default=None,
        help="RabbitMQ URL" + env_help("rabbitmq_url"),
    )


def resolve_settings(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """Resolve settings for a command: flag > env > config file > default."""
    file_data = load_file(getattr(args, "config", None))
    flags = {
        "relay_processes": getattr(args, "processes", None),
        "poll_interval": getattr(args, "poll_interval", None),
        "relay_batch_size": getattr(args, "batch_size", None),
        "relay_keep_published": getattr(args, "keep_published", None),
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


def consumer_prefix(args: argparse.Namespace, reference: str, consumer: Any) -> str:
    """Give ``consumer`` the table prefix it runs with (see config.consumer_table_prefix)."""
    configured, source = _table_prefix(args)
    prefix = consumer_table_prefix(type(consumer), configured, source, reference)
    use_table_prefix(consumer, prefix)
    return prefix
