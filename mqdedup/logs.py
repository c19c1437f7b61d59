"""Logging set-up for the CLI: one line per record, structured context included.

Two formats: ``text`` (the standard line, then the record's ``extra={...}`` fields as
``key=value``) and ``json`` (one JSON object per line: ``time``, ``level``, ``logger``,
``message`` and every structured field — message id, consumer, partition / queue).
Secrets in any URL of a line are masked (:func:`mqdedup.masking.mask_text`).

Third-party client libraries (kafka-python, pika) log every reconnect attempt at
WARNING / ERROR; mqdedup says itself what it waits for, so they are kept quiet unless
the level is DEBUG.

A line that repeats while something waits (a relay waiting for another relay's lease to
expire, a broker that stays away) goes through :class:`RepeatedLog`: written at once,
then after 1 s, 2 s, 4 s, ... (doubling, capped at :data:`MAX_INTERVAL`, 60 s), each
written repeat saying how many were left out since the previous one (``suppressed``).
When the wait ends (:meth:`RepeatedLog.done`), or the line has not come for longer than
the cap, its next occurrence is written at once again.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mqdedup.backoff import Backoff
from mqdedup.masking import mask_text

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Client libraries whose own logging only repeats what mqdedup reports in one line.
NOISY_LIBRARIES = ("kafka", "pika")
#: The first repeat of a waiting line is written this many seconds after the first line.
FIRST_INTERVAL = 1.0
#: The longest time between two written repeats of one waiting line.
MAX_INTERVAL = 60.0


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


#: Waits remembered at most before the quiet ones are forgotten (a relay stopped mid-wait).
_MAX_WAITS = 256


@dataclass
class _Wait:
    next_at: float
    interval: float
    last_seen: float
    suppressed: int = 0


class RepeatedLog:
    """Throttles the repeats of log lines, one wait per ``key`` (the message by default).

    Thread-safe: one instance may serve every relay or worker thread of a process (give
    each its own ``key``, such as the message and the relay id).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        first_interval: float = FIRST_INTERVAL,
        max_interval: float = MAX_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.first_interval = first_interval
        self.max_interval = max_interval
        self.clock = clock
        self._waits: dict[Hashable, _Wait] = {}
        self._lock = threading.Lock()

    def log(
        self,
        level: int,
        message: str,
        *,
        extra: Mapping[str, Any] | None = None,
        key: Hashable = None,
    ) -> bool:
        """Write ``message`` if it is due (see the module docstring); True if written."""
        wait_key = message if key is None else (message, key)
        now = self.clock()
        with self._lock:
            wait = self._waits.get(wait_key)
            if wait is None or now - wait.last_seen > self.max_interval:
                if len(self._waits) >= _MAX_WAITS:  # waits whose owner went away unended
                    self._forget_quiet(now)
                self._waits[wait_key] = _Wait(now + self.first_interval, self.first_interval, now)
                suppressed = 0
            elif now < wait.next_at:
                wait.suppressed += 1
                wait.last_seen = now
                return False
            else:
                suppressed = wait.suppressed
                wait.interval = Backoff(self.first_interval, self.max_interval).after(wait.interval)
                wait.next_at = now + wait.interval
                wait.suppressed = 0
                wait.last_seen = now
        context = dict(extra or {})
        if suppressed:
            context["suppressed"] = suppressed
        self.logger.log(level, message, extra=context)
        return True

    def info(self, message: str, **options: Any) -> bool:
        """:meth:`log` at INFO."""
        return self.log(logging.INFO, message, **options)

    def warning(self, message: str, **options: Any) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, message, **options)

    def _forget_quiet(self, now: float) -> None:
        for wait_key, wait in list(self._waits.items()):
            if now - wait.last_seen > self.max_interval:
                del self._waits[wait_key]

    def forget(self) -> None:
        """Every wait is over: the next line of each is written at once."""
        with self._lock:
            self._waits.clear()

    def done(self, message: str, *, key: Hashable = None) -> None:
        """The wait of ``message`` (and ``key``) is over: its next line is written at once."""
        with self._lock:
            self._waits.pop(message if key is None else (message, key), None)
