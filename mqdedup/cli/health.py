"""``/healthz`` and ``/metrics`` of the worker and relay supervisors: a small HTTP server in
a daemon thread (:class:`HealthServer`), whether a child's latest snapshot allows
readiness, and the Prometheus exposition (through prometheus_client) of the snapshots the
children report every second, labelled by consumer (or relay) and process, with the
supervisor's own process metrics and a build-info gauge."""

from __future__ import annotations

import json
import logging
import platform
import resource
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mqdedup.histograms import HISTOGRAMS

log = logging.getLogger(__name__)


def snapshot_ready(snapshot: Mapping[str, Any]) -> bool:
    """Whether one worker's metrics snapshot allows readiness.

    A transport that reports ``consumer_attached`` (RabbitMQ) is not ready while no
    consumer is attached: the broker closed its channel or the connection is being
    re-established, so nothing is consumed. A worker or relay waiting out an outage
    (``outage``: the database or Redis unreachable, see :mod:`mqdedup.outages`) is not
    ready either, nor one whose pool gave no connection (``connection_shortage``: a pool
    or a pooler too small for the worker, see ``docs/operations.md``) until it commits
    processed messages again, nor a consumer the broker fenced (``fenced``: its reason).
    """
    return (
        snapshot.get("consumer_attached") is not False
        and not snapshot.get("outage")
        and not snapshot.get("connection_shortage")
        and not snapshot.get("fenced")
    )


class HealthServer:
    """A tiny HTTP server in a daemon thread.

    ``status()`` returns ``(live, ready, details)``; ``snapshots()`` the metrics per
    ``(name, process)``. ``/healthz`` answers 200 when live and ready, else 503;
    ``/healthz/live`` and ``/healthz/ready`` answer each alone.
    """

    def __init__(
        self,
        port: int,
        status: Callable[[], tuple[bool, bool, dict[str, Any]]],
        snapshots: Callable[[], Mapping[tuple[str, str], Mapping[str, Any]]],
        shared: Callable[[], Mapping[str, float]] | None = None,
        host: str = "0.0.0.0",  # noqa: S104 - health checks come from outside the pod
    ) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner._serve(self)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._status = status
        self._registry = build_registry(snapshots, shared)
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, daemon=True, name="health"
        )

    def start(self) -> HealthServer:
        """Serve in the background; returns self."""
        self._thread.start()
        log.info("health endpoint listening", extra={"port": self.port})
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(request, 200, render(self._registry), CONTENT_TYPE_LATEST)
            return
        if path in ("/healthz", "/healthz/live", "/healthz/ready"):
            live, ready, details = self._status()
            ok = {"/healthz": live and ready, "/healthz/live": live, "/healthz/ready": ready}[path]
            payload = {"live": live, "ready": ready, "time": time.time(), **details}
            self._reply(
                request, 200 if ok else 503, json.dumps(payload).encode(), "application/json"
            )
            return
        self._reply(request, 404, b"not found\n", "text/plain")

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
        request.send_response(code)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)


# -- /metrics ----------------------------------------------------------------------------------

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
    (
        "mqdedup_pool_timeouts",
        "Times a connection pool (SQLAlchemy's or a pooler's queue) gave no connection",
        "pool_timeouts",
    ),
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
