"""Shared pieces of the ``python -m bench`` suite: settings, result tables, helpers."""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Sizes:
    """How big each suite runs (``--quick`` or the default full mode)."""

    runs: int
    consumer_messages: int
    consumer_slow_messages: int
    relay_rows: int
    latency_rows: int
    claim_table_sizes: tuple[int, ...]
    claim_messages: int
    purge_default_rows: int
    purge_small_chunk_rows: int
    purge_rows: int
    memory_messages: int


FULL = Sizes(
    runs=3,
    consumer_messages=30_000,
    consumer_slow_messages=3_000,
    relay_rows=100_000,
    latency_rows=300,
    claim_table_sizes=(0, 1_000_000, 10_000_000),
    claim_messages=20_000,
    purge_default_rows=1_000_000,
    purge_small_chunk_rows=100_000,
    purge_rows=1_000_000,
    memory_messages=1_000_000,
)

#: ``--quick``: a smoke run of every suite (one run, small sizes, ~30 s on 2 cores);
#: it proves the suite works on this machine, its figures are not for comparison.
QUICK = Sizes(
    runs=1,
    consumer_messages=2_000,
    consumer_slow_messages=300,
    relay_rows=2_000,
    latency_rows=30,
    claim_table_sizes=(0, 50_000, 200_000),
    claim_messages=2_000,
    purge_default_rows=50_000,
    purge_small_chunk_rows=5_000,
    purge_rows=50_000,
    memory_messages=20_000,
)


@dataclass(frozen=True)
class Settings:
    """Service addresses, from ``scripts/services.sh env`` variables."""

    database_url: str
    kafka_bootstrap: str
    rabbitmq_url: str

    @classmethod
    def from_env(cls) -> Settings:
        database = os.environ.get("MQDEDUP_TEST_DATABASE_URL") or os.environ.get(
            "MQDEDUP_DATABASE_URL"
        )
        if not database or not database.startswith("postgresql"):
            raise SystemExit(
                "bench: set MQDEDUP_TEST_DATABASE_URL to a PostgreSQL URL "
                '(eval "$(scripts/services.sh env)")'
            )
        return cls(
            database_url=database,
            kafka_bootstrap=os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
            rabbitmq_url=os.environ.get(
                "MQDEDUP_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"
            ),
        )


@dataclass
class Row:
    """One measured line: a variant, its runs and the unit they are in."""

    variant: str
    values: list[float]
    unit: str
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")


@dataclass
class Section:
    """One suite's result: a titled table (rows), optional free text and errors."""

    key: str
    title: str
    description: str
    rows: list[Row] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    def row(self, variant: str) -> Row | None:
        return next((r for r in self.rows if r.variant == variant), None)


def progress(text: str) -> None:
    """A progress line on stderr (the tables go to results.md and stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def fmt(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "n/a"
    if unit in {"ms", "MiB", "µs"}:
        return f"{value:,.1f}"
    return f"{value:,.0f}"


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


def interleave(
    runs: int, variants: dict[str, Callable[[], float]], label: str
) -> dict[str, list[float]]:
    """Run every variant once per round (drift hits them alike); return all values."""
    values: dict[str, list[float]] = {name: [] for name in variants}
    for run in range(1, runs + 1):
        for name, measure in variants.items():
            started = time.perf_counter()
            value = measure()
            values[name].append(value)
            progress(
                f"{label} run {run}: {name}: {value:,.0f} ({time.perf_counter() - started:.1f} s)"
            )
    return values
