"""The request, answer and settings types the console's pages and router share, and the
helpers every page uses (a whole page, a redirect, the audit record)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sqlalchemy import Engine

from mqdedup.console import data
from mqdedup.console.html import DEFAULT_BODY_LIMIT, Html, page
from mqdedup.console.security import Access, Session
from mqdedup.consumers.base import Consumer

log = logging.getLogger("mqdedup.console")

#: ``consumer_lags(consumers)`` of ``mqdedup status``: entries with ``consumer``,
#: ``where``, ``lag`` and ``error``.
LagReader = Callable[[Sequence[Consumer]], list[dict[str, Any]]]

NAV: tuple[tuple[str, str], ...] = (
    ("/", "Overview"),
    ("/dead-letters", "Dead letters"),
    ("/claims", "Claims"),
    ("/outbox", "Outbox"),
    ("/audit", "Audit"),
)


@dataclass
class Request:
    """One HTTP request, parsed."""

    method: str
    path: str
    query: dict[str, list[str]] = field(default_factory=dict)
    form: dict[str, list[str]] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    client: str = "-"

    @classmethod
    def parse(
        cls, method: str, target: str, headers: Mapping[str, str], body: bytes, client: str
    ) -> Request:
        """From the request line's target, the headers (lower-case names) and the body."""
        parts = urlsplit(target)
        form: dict[str, list[str]] = {}
        if method == "POST":
            form = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
        return cls(method, parts.path or "/", parse_qs(parts.query), form, headers, client)

    def arg(self, name: str, default: str = "") -> str:
        """A query (GET) or form (POST) value."""
        values = (self.form if self.method == "POST" else self.query).get(name)
        return values[0] if values else default

    def args(self, name: str) -> list[str]:
        """Every value of a repeated query / form field."""
        return list((self.form if self.method == "POST" else self.query).get(name, []))


@dataclass
class Response:
    """An answer: status, body, content type and extra headers."""

    status: int
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ConsoleSettings:
    """What the console serves and how."""

    engine: Engine
    prefix: str
    consumers: Sequence[Consumer] = ()
    access: Access = field(default_factory=Access)
    read_only: bool = False
    body_limit: int = DEFAULT_BODY_LIMIT
    #: How far back the overview's charts reach.
    hours: float = 3.0
    lags: LagReader | None = None
    #: The dead-letter places and replay (:mod:`mqdedup.console.deadletters`).
    dead_letters: Any = None
    #: Duplicates per minute from the workers' ``/metrics`` (:mod:`mqdedup.console.metrics`).
    metrics: Any = None
    #: Send the session cookie with ``Secure`` (behind TLS).
    secure_cookie: bool = False


@dataclass
class Context:
    """A request with its session and who made it (None: not signed in)."""

    request: Request
    session: Session
    actor: str | None
    new_cookie: bool = False

    @property
    def who(self) -> str:
        """The actor and the client address, as the audit records them."""
        return f"{self.actor or 'anonymous'}@{self.request.client}"


class ForbiddenError(Exception):
    """A request refused with 403 (the message says why)."""


def document(
    settings: ConsoleSettings, status: int, title: str, body: Html, *, current: str = ""
) -> Response:
    """A whole page as a response."""
    note = "read-only: actions are hidden and refused" if settings.read_only else ""
    return Response(status, page(title, body, nav=NAV, current=current, note=note).encode())


def redirect(location: str) -> Response:
    """303 See Other to a console path."""
    return Response(303, b"", "text/plain", {"Location": location})


def record(
    settings: ConsoleSettings,
    context: Context,
    action: str,
    target: str,
    messages: int,
    outcome: str,
) -> None:
    """Write an action to ``<prefix>audit`` and the log (never a secret)."""
    data.audit(settings.engine, settings.prefix, context.who, action, target, messages, outcome)
    log.info(
        "console action",
        extra={"actor": context.who, "action": action, "target": target, "messages": messages},
    )
