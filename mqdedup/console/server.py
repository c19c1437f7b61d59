"""Serving :class:`~mqdedup.console.app.ConsoleApp` over HTTP with the standard library's
``ThreadingHTTPServer`` (one thread per request; nothing to build, no web framework)."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mqdedup.console.app import ConsoleApp
from mqdedup.console.web import Request, Response

log = logging.getLogger(__name__)

#: The largest request body read (the forms carry keys and a token, nothing big).
MAX_BODY_BYTES = 1024 * 1024


class ConsoleServer:
    """The console listening on ``host:port`` (port 0: any free port, see :attr:`port`)."""

    def __init__(self, app: ConsoleApp, host: str, port: int) -> None:
        owner = app

        class Handler(BaseHTTPRequestHandler):
            server_version = "mqdedup-console"
            sys_version = ""

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def do_HEAD(self) -> None:
                self._answer("GET", body=False)

            def _answer(self, method: str, body: bool = True) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self._send(Response(413, b"request too large\n", "text/plain"), body)
                    return
                raw = self.rfile.read(length) if length > 0 else b""
                headers = {name.lower(): value for name, value in self.headers.items()}
                request = Request.parse(method, self.path, headers, raw, self.client_address[0])
                self._send(owner.handle(request), body)

            def _send(self, response: Response, body: bool) -> None:
                self.send_response(response.status)
                self.send_header("Content-Type", response.content_type)
                self.send_header("Content-Length", str(len(response.body)))
                for name, value in response.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(response.body)

            def log_message(self, format: str, *args: Any) -> None:
                # The request line only: never headers (they carry the credentials).
                log.debug(
                    "console request",
                    extra={"client": self.client_address[0], "request": self.requestline[:200]},
                )

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host = host
        self.port = int(self.server.server_address[1])

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or KeyboardInterrupt)."""
        self.server.serve_forever(poll_interval=0.5)

    def start(self) -> ConsoleServer:
        """Serve in a daemon thread (tests); returns self."""
        threading.Thread(target=self.serve_forever, daemon=True, name="console").start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
