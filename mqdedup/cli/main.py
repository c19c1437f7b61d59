"""The entry point of the ``mqdedup`` command: parse the arguments, set up logging, run the
chosen sub-command; user mistakes end with one line on stderr and a documented exit code
(:mod:`mqdedup.cli.exitcodes`), ``--debug`` adds the traceback. A reader that goes away
(``mqdedup status | head``) ends the command quietly (:data:`~exitcodes.BROKEN_PIPE`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from mqdedup import interrupts
from mqdedup.cli import exitcodes
from mqdedup.cli.config import resolve_settings
from mqdedup.cli.parser import build_parser, parse_log_level
from mqdedup.errors import (
    ConfigurationError,
    MqdedupError,
)
from mqdedup.logs import configure as configure_logging
from mqdedup.masking import mask_text

log = logging.getLogger("mqdedup.cli")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    try:
        interrupts.restore()  # from here on, Ctrl-C is caught below and in run_parsed
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("mqdedup: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
    except BrokenPipeError:  # --help into a pipe already closed
        return _reader_gone()
    return run_parsed(args)


def run_parsed(args: argparse.Namespace) -> int:
    """Run parsed arguments as ``main`` does (the Django management commands use it)."""
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        _configure_logging(args)
        code = run(args)
        sys.stdout.flush()  # here, not at exit: a reader gone is still answered below
        return code
    except BrokenPipeError:
        return _reader_gone()
    except MqdedupError as exc:
        if args.debug:
            log.exception("failed")
        print(f"mqdedup: error: {mask_text(str(exc))}", file=sys.stderr)
        return exitcodes.exit_code_for(exc)
    except KeyboardInterrupt:
        print("mqdedup: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


def _reader_gone() -> int:
    """The output's reader closed the pipe: no traceback, no "Exception ignored" at exit
    (what is left in stdout's buffer goes to /dev/null), the SIGPIPE convention's code."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return exitcodes.BROKEN_PIPE


def _configure_logging(args: argparse.Namespace) -> None:
    """Log level and format: flag > ``MQDEDUP_LOG_LEVEL`` / ``_FORMAT`` > TOML > default.

    The resolved values are written back to ``args`` so worker children get the same.
    """
    settings = resolve_settings(args, "log_level", "log_format")
    try:
        args.log_level = parse_log_level(str(settings["log_level"]))
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(str(exc)) from None
    args.log_format = str(settings["log_format"])
    if args.log_format not in ("text", "json"):
        raise ConfigurationError(f"unknown log format {args.log_format!r} (choose text or json)")
    configure_logging(args.log_level, args.log_format)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
