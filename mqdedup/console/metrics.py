"""Duplicates per minute, from the workers' ``/metrics``.

No table records a duplicate (a duplicate writes nothing), so the overview's duplicates
come from the counters the worker supervisors serve (``--health-port``):
``mqdedup_messages_duplicates_total`` per consumer and process. :class:`MetricsSampler`
reads the given ``/metrics`` URLs once a minute and keeps each consumer's increase per
minute, summed over its processes (a process's counter that went down, a restarted
child, counts from zero). It keeps what it saw since the console started, up to a day.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from mqdedup.dedup.store import utcnow
from mqdedup.masking import mask_url

log = logging.getLogger(__name__)

DUPLICATES = "mqdedup_messages_duplicates_total"
#: How long samples are kept.
KEEP = timedelta(days=1)
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_CONSUMER = re.compile(r'(?:^|,)\s*consumer="(?P<consumer>(?:[^"\\]|\\.)*)"')


def totals(text: str, counter: str = DUPLICATES) -> dict[str, float]:
    """``counter`` per consumer label, summed over processes, from a Prometheus text."""
    found: dict[str, float] = {}
    for (name, _), value in series(text, counter).items():
        found[name] = found.get(name, 0.0) + value
    return found


def series(text: str, counter: str = DUPLICATES) -> dict[tuple[str, str], float]:
    """``counter`` per ``(consumer, all labels)``: one value per worker process."""
    found: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group("name") != counter:
            continue
        consumer = _CONSUMER.search(match.group("labels"))
        if consumer is None:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        found[(consumer.group("consumer"), match.group("labels"))] = value
    return found


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - the operator's URL
        body: bytes = response.read()
    return body.decode("utf-8", errors="replace")


class MetricsSampler:
    """Duplicates per consumer and minute, sampled from ``/metrics`` URLs."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        interval: float = 60.0,
        fetch: Callable[[str], str] = _fetch,
    ) -> None:
        self.urls = list(urls)
        self.interval = interval
        self._fetch = fetch
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str], float] = {}
        self._increase: dict[str, dict[datetime, int]] = {}
        self._stop = threading.Event()
        self.error: str | None = None

    def sample(self, now: datetime | None = None) -> None:
        """Read every URL once and record each consumer's increase since the last read."""
        minute = (now or utcnow()).replace(second=0, microsecond=0)
        current: dict[tuple[str, str, str], float] = {}
        errors = []
        for url in self.urls:
            try:
                for (name, labels), value in series(self._fetch(url)).items():
                    current[(url, name, labels)] = value
            except Exception as exc:  # one worker down must not stop the others' figures
                errors.append(f"{mask_url(url)}: {type(exc).__name__}")
        with self._lock:
            self.error = "; ".join(errors) or None
            for key, value in current.items():
                before = self._last.get(key)
                if before is not None:  # a process's counter that went down restarted at 0
                    grown = value - before if value >= before else value
                    counts = self._increase.setdefault(key[1], {})
                    counts[minute] = counts.get(minute, 0) + int(grown)
                self._last[key] = value
            for counts in self._increase.values():
                for old in [m for m in counts if m < minute - KEEP]:
                    del counts[old]

    def per_minute(self) -> dict[str, dict[datetime, int]]:
        """Duplicates per consumer name and minute (a copy)."""
        with self._lock:
            return {name: dict(counts) for name, counts in self._increase.items()}

    def start(self) -> MetricsSampler:
        """Sample now and then every ``interval`` seconds, in a daemon thread."""
        threading.Thread(target=self._run, daemon=True, name="console-metrics").start()
        return self

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if self.error:
                log.warning("metrics unreadable", extra={"error": self.error})
            self._stop.wait(self.interval)
