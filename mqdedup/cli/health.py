"""``/healthz`` and ``/metrics`` (Prometheus text format) for workers and relays."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from mqdedup.cli.exposition import build_registry, render

log = logging.getLogger(__name__)


def snapshot_ready(snapshot: Mapping[str, Any]) -> bool:
    """Whether one worker's metrics snapshot allows readiness.

    A transport that reports ``consumer_attached`` (RabbitMQ) is not ready while no
    consumer is attached: the broker closed its channel or the connection is being
    re-established, so nothing is consumed. A worker or relay waiting out an outage
    (``outage``: the database or Redis unreachable, see :mod:`mqdedup.outages`) is not
    ready either.
    """
    return snapshot.get("consumer_attached") is not False and not snapshot.get("outage")


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
