"""``/healthz`` and ``/metrics`` (Prometheus text format) for workers and relays."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

#: Metric name, Prometheus type, help text, and the snapshot key it comes from.
COUNTERS: tuple[tuple[str, str, str, str], ...] = (
    ("mqdedup_messages_delivered_total", "counter", "Deliveries fetched", "delivered"),
    (
        "mqdedup_messages_processed_total",
        "counter",
        "Messages whose handler committed",
        "processed",
    ),
    (
        "mqdedup_messages_duplicates_total",
        "counter",
        "Deliveries skipped as duplicates",
        "duplicates",
    ),
    ("mqdedup_messages_dead_lettered_total", "counter", "Messages dead-lettered", "dead_lettered"),
    (
        "mqdedup_dead_letter_failures_total",
        "counter",
        "Dead-letter publishes the broker refused or could not take",
        "dead_letter_failures",
    ),
    (
        "mqdedup_dead_letters_parked_total",
        "counter",
        "Dead letters kept in the database because the broker refused them",
        "dead_letters_parked",
    ),
    ("mqdedup_handler_retries_total", "counter", "Handler retries", "retries"),
    (
        "mqdedup_database_retries_total",
        "counter",
        "Transactions retried for outages",
        "database_retries",
    ),
    ("mqdedup_batches_total", "counter", "Batches processed", "batches"),
    ("mqdedup_batch_seconds_total", "counter", "Seconds spent processing batches", "batch_seconds"),
    (
        "mqdedup_channel_reopens_total",
        "counter",
        "Consuming channels opened again after the broker closed them or the connection broke",
        "channel_reopens",
    ),
    ("mqdedup_outbox_published_total", "counter", "Outbox rows published", "published"),
    ("mqdedup_outbox_failed_total", "counter", "Outbox rows marked failed", "failed"),
)
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


def snapshot_ready(snapshot: Mapping[str, Any]) -> bool:
    """Whether one worker's metrics snapshot allows readiness.

    A transport that reports ``consumer_attached`` (RabbitMQ) is not ready while no
    consumer is attached: the broker closed its channel or the connection is being
    re-established, so nothing is consumed.
    """
    return snapshot.get("consumer_attached") is not False


def _value(value: Any) -> Any:
    """Prometheus sample text of a snapshot value (booleans as 1/0)."""
    return int(value) if isinstance(value, bool) else value


def _labels(labels: Mapping[str, str]) -> str:
    inner = ",".join(
        f'{key}="{str(value).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for key, value in sorted(labels.items())
    )
    return "{" + inner + "}" if inner else ""


def render_prometheus(
    snapshots: Mapping[tuple[str, str], Mapping[str, Any]],
    shared: Mapping[str, float] | None = None,
) -> str:
    """Prometheus text for ``{(name, process): metrics snapshot}`` plus ``shared`` gauges
    that belong to no process (e.g. the outbox backlog, read from the database)."""
    lines: list[str] = []
    for metric, help_text, key in GAUGES:
        if shared and key in shared:
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
            lines.append(f"{metric} {shared[key]}")
    for metric, kind, help_text, key in COUNTERS:
        rows = [
            (ident, _value(snap[key]))
            for ident, snap in snapshots.items()
            if snap.get(key) is not None
        ]
        if not rows:
            continue
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        lines += [f"{metric}{_labels({'consumer': n, 'process': p})} {v}" for (n, p), v in rows]
    for metric, help_text, key in GAUGES:
        rows = [
            (ident, _value(snap[key]))
            for ident, snap in snapshots.items()
            if snap.get(key) is not None
        ]
        if not rows or (shared and key in shared):
            continue
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        lines += [f"{metric}{_labels({'consumer': n, 'process': p})} {v}" for (n, p), v in rows]
    lag_rows = [
        (ident, partition, value)
        for ident, snap in snapshots.items()
        for partition, value in (snap.get("lag") or {}).items()
    ]
    if lag_rows:
        lines += [
            "# HELP mqdedup_consumer_lag Messages behind the end of the partition",
            "# TYPE mqdedup_consumer_lag gauge",
        ]
        lines += [
            f"mqdedup_consumer_lag{_labels({'consumer': n, 'process': p, 'partition': part})} {v}"
            for (n, p), part, v in lag_rows
        ]
    return "\n".join(lines) + "\n"


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
        self._snapshots = snapshots
        self._shared = shared
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
            shared = self._shared() if self._shared is not None else None
            body = render_prometheus(self._snapshots(), shared).encode()
            self._reply(request, 200, body, "text/plain; version=0.0.4; charset=utf-8")
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
