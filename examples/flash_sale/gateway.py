"""A fake payment API: a real HTTP server that deduplicates on the ``Idempotency-Key``
header and counts charges, as a payment provider does; and the client the consumer uses.

``python -m examples.flash_sale.gateway --port 8099`` runs it (until Ctrl-C); the tests
run :class:`PaymentServer` in their own process on a free port.

``POST /charge`` with a JSON body ``{"order": ..., "amount": ...}`` and an
``Idempotency-Key`` header: the first request of a key makes a charge; a later one with
the same key gets the same charge back (``"replayed": true``) and charges nothing. A
request without the header is refused (400).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Ledger:
    """What the server did: one charge per key, and every request counted."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    charges: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> charge
    requests: Counter[str] = field(default_factory=Counter)  # order -> requests

    def charge(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.requests[str(body.get("order"))] += 1
            existing = self.charges.get(key)
            if existing is not None:
                return {**existing, "replayed": True}
            charge = {"charge_id": f"ch_{len(self.charges) + 1}", **body}
            self.charges[key] = charge
            return {**charge, "replayed": False}

    def charges_per_order(self) -> Counter[str]:
        with self.lock:
            return Counter(str(charge["order"]) for charge in self.charges.values())


class PaymentServer:
    """Run with ``with PaymentServer() as server:``; ``server.url`` is its base URL."""

    def __init__(self, port: int = 0) -> None:
        self.ledger = Ledger()
        ledger = self.ledger

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key")
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path != "/charge" or not key:
                    self._reply(400, {"error": "POST /charge with an Idempotency-Key header"})
                    return
                self._reply(200, ledger.charge(key, body))

            def _reply(self, status: int, document: dict[str, Any]) -> None:
                data = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: Any) -> None:  # quiet
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> PaymentServer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


def charge(url: str, key: str, order: dict[str, Any]) -> dict[str, Any]:
    """Charge ``order`` once per ``key``: the key goes as the ``Idempotency-Key`` header
    and as the merchant order number (``merchant_order_no``), the two ways payment APIs
    deduplicate. Returns the gateway's charge (``charge_id``; the same on a repeat)."""
    body = {
        "order": order["order_id"],
        "merchant_order_no": key,
        "amount": order["amount_cents"],
    }
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the payment API URL must be http(s)://, got {url!r}")
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked above
        f"{url}/charge",
        data=json.dumps(body).encode(),
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310
        charged: dict[str, Any] = json.load(reply)
    return charged


def main() -> None:
    """Serve on ``--port`` until interrupted, then print the charges per order."""
    parser = argparse.ArgumentParser(description="a fake payment API deduplicating on keys")
    parser.add_argument("--port", type=int, default=8099)
    args = parser.parse_args()
    with PaymentServer(args.port) as server:
        print(f"payment API on {server.url} (Ctrl-C to stop)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    charged = server.ledger.charges_per_order()
    print(f"{len(charged)} orders charged, {sum(charged.values()) - len(charged)} twice")


if __name__ == "__main__":
    main()
