"""A Ctrl-C while the ``mqdedup`` command is still starting (importing the framework takes
a moment) ends it quietly: one line, exit code 130, no ``KeyboardInterrupt`` traceback.

The package imports this module first. It acts only in the ``mqdedup`` console script and
only while SIGINT has Python's default handler (a program importing mqdedup keeps its own);
:func:`mqdedup.cli.main.main` puts the default handler back as soon as it catches
``KeyboardInterrupt`` itself. Standard library only, so that it is in place at once.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # C module (`signal` imports enum: slow)
import os
import sys
from types import FrameType

#: The exit code of an interrupted command (``mqdedup.cli.exitcodes.INTERRUPTED``).
INTERRUPTED = 130


def _quiet(_signum: int, _frame: FrameType | None) -> None:
    sys.stderr.write("mqdedup: interrupted\n")
    raise SystemExit(INTERRUPTED)


def _console_script() -> bool:
    main = sys.modules.get("__main__")
    return os.path.basename(str(getattr(main, "__file__", None) or "")) == "mqdedup"


def quiet_while_starting() -> None:
    """In the ``mqdedup`` command: SIGINT exits quietly until :func:`restore` is called."""
    if _console_script() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        try:
            _signal.signal(_signal.SIGINT, _quiet)
        except ValueError:  # not the main thread: leave signals alone
            return


def restore() -> None:
    """Back to Python's ``KeyboardInterrupt`` (the command now catches it itself)."""
    if _signal.getsignal(_signal.SIGINT) is _quiet:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


quiet_while_starting()
