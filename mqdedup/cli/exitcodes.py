"""Exit codes of the ``mqdedup`` command (documented in README.md): which error ends a run
with which code, including :class:`RefusedError`, a safety check that refused to go on."""

from __future__ import annotations

from mqdedup.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConsumerImportError,
    DatabaseUnavailableError,
    MqdedupError,
)

OK = 0
#: A check failed (``demo`` found a broken promise, ``db check`` found schema drift), or a
#: safety check refused to go on (a replay before the retention horizon, ``dedup purge``
#: below one day without ``--yes``, ``demo`` over a non-empty ``demo_orders`` without
#: ``--force``).
CHECK_FAILED = 1
#: Wrong command-line usage (argparse): unknown flag or log level, malformed duration.
USAGE = 2
#: A setting is missing, malformed or unknown (database URL, consumer attribute, flag value,
#: a key of the TOML file, a health port out of range or in use).
CONFIGURATION = 3
#: A ``module:Class`` consumer reference could not be imported, is not a consumer, or cannot
#: be created without arguments.
CONSUMER_IMPORT = 4
#: The database could not be reached.
DATABASE_UNAVAILABLE = 5
#: The broker could not be reached (after the consumer's start-up timeout).
BROKER_UNAVAILABLE = 6
#: Stopped by a second SIGINT/SIGTERM.
INTERRUPTED = 130
#: Children did not drain within ``--shutdown-timeout`` and were killed.
SHUTDOWN_TIMEOUT = 7
#: Exit codes of a child that restarting cannot fix: the supervisor stops with them.
FATAL_CHILD_CODES = frozenset({CONFIGURATION, CONSUMER_IMPORT})


class RefusedError(MqdedupError):
    """A safety check refused an action that could lose protection or data.

    Exit code 1 (``CHECK_FAILED``); the message names the flag that overrides it
    (``--yes``, ``--force``, ``--allow-reprocess``).
    """


_BY_ERROR: dict[type[MqdedupError], int] = {
    ConfigurationError: CONFIGURATION,
    ConsumerImportError: CONSUMER_IMPORT,
    DatabaseUnavailableError: DATABASE_UNAVAILABLE,
    BrokerUnavailableError: BROKER_UNAVAILABLE,
    RefusedError: CHECK_FAILED,
}


def exit_code_for(error: MqdedupError) -> int:
    """The documented exit code of an error (a setting's problem when none fits better)."""
    return next(
        (code for kind, code in _BY_ERROR.items() if isinstance(error, kind)),
        CONFIGURATION,
    )
