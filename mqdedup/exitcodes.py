"""Exit codes of the ``mqdedup`` command (documented in README.md)."""

from __future__ import annotations

OK = 0
#: A check failed (``demo`` found a broken promise, ``db check`` found schema drift).
CHECK_FAILED = 1
#: Wrong command-line usage (argparse).
USAGE = 2
#: A setting is missing or malformed (database URL, consumer attribute, flag value).
CONFIGURATION = 3
#: A ``module:Class`` consumer reference could not be imported or is not a consumer.
CONSUMER_IMPORT = 4
#: The database could not be reached.
DATABASE_UNAVAILABLE = 5
#: The broker could not be reached.
BROKER_UNAVAILABLE = 6
#: Stopped by a second SIGINT/SIGTERM.
INTERRUPTED = 130
#: Children did not drain within ``--shutdown-timeout`` and were killed.
SHUTDOWN_TIMEOUT = 7
#: Exit codes of a child that restarting cannot fix: the supervisor stops with them.
FATAL_CHILD_CODES = frozenset({CONFIGURATION, CONSUMER_IMPORT})
