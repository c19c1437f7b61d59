"""The management commands' shared part: ``mqdedup worker`` / ``relay`` on Django's
settings, through the CLI's own parser, supervisor, health and metrics."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from mqdedup.cli.exitcodes import CONFIGURATION
from mqdedup.cli.main import run_parsed
from mqdedup.cli.parser import build_parser
from mqdedup.db.engine import check_schema
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.django.conf import SETTINGS_NAME, _settings, database_url
from mqdedup.django.connection import engine
from mqdedup.errors import ConfigurationError

#: Options of manage.py itself, applied before the command runs.
_DJANGO_OPTIONS = ("--settings", "--pythonpath")
WORKER_RUNNER = "mqdedup.django.runners:run_consumer"


def run_command(command: str, arguments: Sequence[str]) -> int:
    """Run ``mqdedup <command> <arguments>`` on the Django project's database.

    The database is ``MQDEDUP["DATABASE"]`` (its URL is handed to the CLI's checks and,
    for the relay, to its processes); ``MQDEDUP["TABLE_PREFIX"]`` becomes the table
    prefix. Worker processes run the consumers on Django's connection.
    """
    arguments = _without_django_options(arguments)
    try:
        if "--database" in arguments or any(a.startswith("--database=") for a in arguments):
            raise ConfigurationError(
                f"--database is not for manage.py: the database is settings.{SETTINGS_NAME}"
                "['DATABASE'] (default: 'default')"
            )
        os.environ["MQDEDUP_DATABASE_URL"] = database_url()
        prefix = _settings().get("TABLE_PREFIX")
        if prefix:
            os.environ["MQDEDUP_TABLE_PREFIX"] = str(prefix)
    except ConfigurationError as error:
        print(f"mqdedup: error: {error}", file=sys.stderr)
        return CONFIGURATION
    args = _parser(command).parse_args([command, *arguments])  # exits for --help
    problem = _unmigrated()
    if problem:
        print(f"mqdedup: error: {problem}", file=sys.stderr)
        return CONFIGURATION
    if command == "worker":
        args.worker_runner = WORKER_RUNNER
    return run_parsed(args)


def _parser(command: str) -> argparse.ArgumentParser:
    """mqdedup's parser, its usage lines naming the management command."""
    parser = build_parser()
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        choices = getattr(action, "choices", None) or {}
        if command in choices:
            choices[command].prog = f"manage.py mqdedup_{command}"
    return parser


def _unmigrated() -> str | None:
    """Why mqdedup's tables are not usable yet (``manage.py migrate`` fixes it), if so."""
    prefix = str(_settings().get("TABLE_PREFIX") or DEFAULT_PREFIX)
    try:
        problems = check_schema(engine(), prefix)
    except Exception:  # unreachable and the like: the CLI's own check says it in one line
        return None
    if not problems:
        return None
    first = problems[0].removesuffix(" (run `mqdedup db upgrade`)")
    return f"mqdedup's tables are not migrated ({first}): run `manage.py migrate`"


def _without_django_options(arguments: Sequence[str]) -> list[str]:
    """``arguments`` without ``--settings X`` / ``--pythonpath X`` (manage.py's)."""
    kept: list[str] = []
    skip = False
    for argument in arguments:
        if skip:
            skip = False
            continue
        if argument in _DJANGO_OPTIONS:
            skip = True
            continue
        if argument.startswith(tuple(f"{option}=" for option in _DJANGO_OPTIONS)):
            continue
        kept.append(argument)
    return kept
