"""Logging set-up for the CLI: one line per record, structured context as key=value."""

from __future__ import annotations

import logging
import sys

from mqdedup.masking import mask_text

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    """Appends the record's ``extra={...}`` fields as ``key=value`` pairs.

    Any URL in the line (a driver error echoing its DSN, a traceback) has its secrets
    masked (:func:`mqdedup.masking.mask_text`).
    """

    def format(self, record: logging.LogRecord) -> str:
        """The standard line followed by the structured context."""
        line = super().format(record)
        context = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if context:
            line += " " + " ".join(f"{key}={value!r}" for key, value in sorted(context.items()))
        return mask_text(line)


def configure(level: str = "INFO") -> None:
    """Send ``mqdedup`` logs to stderr with structured context."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
