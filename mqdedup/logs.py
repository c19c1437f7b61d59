"""Logging set-up for the CLI: one line per record, structured context included.

Two formats: ``text`` (the standard line, then the record's ``extra={...}`` fields as
``key=value``) and ``json`` (one JSON object per line: ``time``, ``level``, ``logger``,
``message`` and every structured field — message id, consumer, partition / queue).
Secrets in any URL of a line are masked (:func:`mqdedup.masking.mask_text`).

Third-party client libraries (kafka-python, pika) log every reconnect attempt at
WARNING / ERROR; mqdedup says itself what it waits for, so they are kept quiet unless
the level is DEBUG.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from mqdedup.masking import mask_text

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Client libraries whose own logging only repeats what mqdedup reports in one line.
NOISY_LIBRARIES = ("kafka", "pika", "aio_pika", "aiormq", "aiokafka")


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class KeyValueFormatter(logging.Formatter):
    """Appends the record's ``extra={...}`` fields as ``key=value`` pairs."""

    def format(self, record: logging.LogRecord) -> str:
        """The standard line followed by the structured context."""
        line = super().format(record)
        context = _context(record)
        if context:
            line += " " + " ".join(f"{key}={value!r}" for key, value in sorted(context.items()))
        return mask_text(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        entry.update(_context(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return mask_text(json.dumps(entry, default=repr, ensure_ascii=False))


def validate_level(level: str) -> str:
    """``level`` in upper case, or ValueError naming the valid ones."""
    name = str(level).upper()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: use one of {', '.join(LEVELS)}")
    return name


def configure(level: str = "INFO", log_format: str = "text") -> None:
    """Send logs to stderr in ``log_format`` at ``level``; quiet noisy client libraries."""
    name = validate_level(level)
    if log_format not in FORMATS:
        raise ValueError(f"unknown log format {log_format!r}: use text or json")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(name)
    for library in NOISY_LIBRARIES:
        logging.getLogger(library).setLevel(logging.NOTSET if name == "DEBUG" else logging.CRITICAL)
