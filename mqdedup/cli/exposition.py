"""``/metrics``: the supervisor's view of its children, through prometheus_client.

Worker and relay children run in processes of their own and report plain snapshots (a
:class:`~mqdedup.consumers.metrics.Metrics` or relay counters, histograms, process
figures) to their supervisor every second. :class:`SnapshotCollector` turns the latest
snapshots into metric families at scrape time, labelled by ``consumer`` (or relay) and
``process``; the supervisor's own process metrics and a build-info gauge come with them.
"""

from __future__ import annotations

import platform
import resource
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mqdedup.histograms import HISTOGRAMS

Snapshots = Mapping[tuple[str, str], Mapping[str, Any]]

#: Counter name (without ``_total``), help text, and the snapshot key it comes from.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("mqdedup_messages_delivered", "Deliveries fetched", "delivered"),
    ("mqdedup_messages_processed", "Messages whose handler committed", "processed"),
    ("mqdedup_messages_duplicates", "Deliveries skipped as duplicates", "duplicates"),
    ("mqdedup_messages_dead_lettered", "Messages dead-lettered", "dead_lettered"),
    (
        "mqdedup_dead_letter_failures",
        "Dead-letter publishes the broker refused or could not take",
        "dead_letter_failures",
    ),
    (
        "mqdedup_dead_letters_parked",
        "Dead letters kept in the database because the broker refused them",
        "dead_letters_parked",
    ),
    ("mqdedup_handler_retries", "Handler retries", "retries"),
    ("mqdedup_database_retries", "Transactions retried for outages", "database_retries"),
    ("mqdedup_batches", "Batches processed", "batches"),
    ("mqdedup_batch_seconds", "Seconds spent processing batches", "batch_seconds"),
    (
        "mqdedup_channel_reopens",
        "Consuming channels opened again after the broker closed them or the connection broke",
        "channel_reopens",
    ),
    ("mqdedup_outbox_published", "Outbox rows published", "published"),
    ("mqdedup_outbox_failed", "Outbox rows marked failed", "failed"),
)
#: Gauge name, help text, snapshot key.
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("mqdedup_outbox_backlog", "Outbox rows waiting to be published", "backlog"),
    (
        "mqdedup_outbox_oldest_pending_seconds",
        "Age of the oldest pending outbox row",
        "oldest_pending_seconds",
    ),
    (
        "mqdedup_consumer_attached",
        "1 while a consumer is attached to the broker, 0 while detached",
        "consumer_attached",
    ),
)
_LABELS = ["consumer", "process"]


def process_stats() -> dict[str, float]:
    """This process's CPU seconds and resident memory (reported by each child)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = {"cpu_seconds": usage.ru_utime + usage.ru_stime}
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
        stats["resident_memory_bytes"] = float(pages * resource.getpagesize())
    except (OSError, ValueError, IndexError):  # not Linux: the peak instead
        stats["resident_memory_bytes"] = float(usage.ru_maxrss * 1024)
    return stats


class SnapshotCollector(Collector):
    """Metric families built from the children's latest snapshots at each scrape."""

    def __init__(
        self, snapshots: Callable[[], Snapshots], shared: Callable[[], Mapping[str, float]] | None
    ) -> None:
        self._snapshots = snapshots
        self._shared = shared

    def collect(self) -> Iterator[Metric]:
        """Counters, gauges, lag, histograms and process figures per child."""
        snapshots = self._snapshots()
        shared = dict(self._shared()) if self._shared is not None else {}
        for name, help_text, key in COUNTERS:
            rows = _rows(snapshots, key)
            if rows:
                family = CounterMetricFamily(name, help_text, labels=_LABELS)
                for (consumer, process), value in rows:
                    family.add_metric([consumer, process], float(value))
                yield family
        yield from self._gauges(snapshots, shared)
        yield from self._lag(snapshots)
        yield from self._histograms(snapshots)
        yield from self._processes(snapshots)

    @staticmethod
    def _gauges(snapshots: Snapshots, shared: Mapping[str, float]) -> Iterator[Metric]:
        for name, help_text, key in GAUGES:
            if key in shared:
                yield GaugeMetricFamily(name, help_text, value=float(shared[key]))
                continue
            rows = _rows(snapshots, key)
            if rows:
                family = GaugeMetricFamily(name, help_text, labels=_LABELS)
                for (consumer, process), value in rows:
                    family.add_metric([consumer, process], float(value))
                yield family

    @staticmethod
    def _lag(snapshots: Snapshots) -> Iterator[Metric]:
        rows = [
            (ident, partition, value)
            for ident, snap in snapshots.items()
            for partition, value in (snap.get("lag") or {}).items()
        ]
        if rows:
            family = GaugeMetricFamily(
                "mqdedup_consumer_lag",
                "Messages behind the end of the partition",
                labels=[*_LABELS, "partition"],
            )
            for (consumer, process), partition, value in rows:
                family.add_metric([consumer, process, str(partition)], float(value))
            yield family

    @staticmethod
    def _histograms(snapshots: Snapshots) -> Iterator[Metric]:
        for name, help_text in HISTOGRAMS.items():
            rows = [
                (ident, snap["histograms"][name])
                for ident, snap in snapshots.items()
                if name in (snap.get("histograms") or {})
            ]
            if not rows:
                continue
            family = HistogramMetricFamily(f"mqdedup_{name}", help_text, labels=_LABELS)
            for (consumer, process), data in rows:
                family.add_metric(
                    [consumer, process],
                    buckets=[(str(bound), float(count)) for bound, count in data["buckets"]],
                    sum_value=float(data["sum"]),
                )
            yield family

    @staticmethod
    def _processes(snapshots: Snapshots) -> Iterator[Metric]:
        rows = [(ident, snap["process"]) for ident, snap in snapshots.items() if "process" in snap]
        if not rows:
            return
        cpu = CounterMetricFamily(
            "mqdedup_process_cpu_seconds", "CPU seconds of a worker / relay child", labels=_LABELS
        )
        memory = GaugeMetricFamily(
            "mqdedup_process_resident_memory_bytes",
            "Resident memory of a worker / relay child",
            labels=_LABELS,
        )
        for (consumer, process), stats in rows:
            cpu.add_metric([consumer, process], float(stats["cpu_seconds"]))
            memory.add_metric([consumer, process], float(stats["resident_memory_bytes"]))
        yield cpu
        yield memory


class BuildInfoCollector(Collector):
    """``mqdedup_build_info{version, python}``: which mqdedup answers."""

    def collect(self) -> Iterator[Metric]:
        """One info family."""
        info = InfoMetricFamily("mqdedup_build", "mqdedup version and Python version")
        info.add_metric([], {"version": _version(), "python": platform.python_version()})
        yield info


def build_registry(
    snapshots: Callable[[], Snapshots], shared: Callable[[], Mapping[str, float]] | None = None
) -> CollectorRegistry:
    """The registry a supervisor serves: its children, its own process, build info."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots, shared))
    registry.register(BuildInfoCollector())
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)


def render_snapshots(snapshots: Snapshots, shared: Mapping[str, float] | None = None) -> str:
    """Prometheus text for fixed snapshots (tests, one-off dumps)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshots, (lambda: shared) if shared else None))
    return render(registry).decode()


def _rows(snapshots: Snapshots, key: str) -> list[tuple[tuple[str, str], float]]:
    """``(ident, value)`` of every snapshot that reports ``key`` (booleans as 1 / 0)."""
    return [
        (ident, float(snap[key])) for ident, snap in snapshots.items() if snap.get(key) is not None
    ]


def _version() -> str:
    try:
        return metadata.version("mqdedup")
    except metadata.PackageNotFoundError:
        return "unknown"
