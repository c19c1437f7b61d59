"""Exit codes of the ``mqdedup`` command (documented in README.md and docs/operations.md,
"The command line"): which error ends a run with which code, including
:class:`UsageError` (the command line itself is wrong) and :class:`RefusedError` (a safety
check that refused to go on).

One code per kind of mistake: the command line (2: a flag or argument of this command,
malformed, out of range or contradicting another, whether argparse or the command finds
it), a setting (3: anything that can also come from ``MQDEDUP_*`` or the TOML file, the
consumer class's attributes, the database's tables), the consumer reference (4), the
database (5) or broker (6) out of reach."""

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
#: Wrong command-line usage: an unknown flag, command or log level; a missing or malformed
#: argument (a duration, a ``--from`` / ``--to`` position, a number out of range); flags
#: that contradict each other or the consumer; an inverted range (``--from 5 --to 2``).
USAGE = 2
#: A setting is missing, malformed or unknown, wherever it came from (a flag with an
#: ``MQDEDUP_*`` variable, the environment, the TOML file): a database URL, ``--processes
#: 0``, a key of the TOML file, a health port out of range or in use; a consumer attribute;
#: tables of another version.
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
#: ``replay`` finished, but dead-lettered messages (handler failures or messages without a
#: message id): the summary says how many; they are in the dead-letter topic / queue.
DEAD_LETTERED = 8
#: ``relay --drain`` ended with rows it could not publish: the broker refused rows (they
#: wait for their retry, or were marked failed after their last attempt) or was still
#: unavailable when ``--drain-timeout`` passed.
NOT_DRAINED = 9
#: The output's reader went away (``mqdedup status | head``): the command stops quietly,
#: with the code of a process ended by SIGPIPE (128 + 13), as ``cat`` or ``git log`` do.
BROKEN_PIPE = 141
#: Children did not drain within ``--shutdown-timeout`` and were killed.
SHUTDOWN_TIMEOUT = 7
#: Exit codes of a child that restarting cannot fix: the supervisor stops with them.
FATAL_CHILD_CODES = frozenset({CONFIGURATION, CONSUMER_IMPORT})


class RefusedError(MqdedupError):
    """A safety check refused an action that could lose protection or data.

    Exit code 1 (``CHECK_FAILED``); the message names the flag that overrides it
    (``--yes``, ``--force``, ``--allow-reprocess``).
    """


class UsageError(ConfigurationError):
    """The command line is wrong: a malformed or out-of-range argument, flags that
    contradict each other, an inverted range. Exit code 2 (``USAGE``), as argparse's own."""


_BY_ERROR: dict[type[MqdedupError], int] = {
    UsageError: USAGE,  # before ConfigurationError, its base
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
