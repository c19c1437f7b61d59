"""The console's guards: where it may listen, who may use it, and which requests may act.

* :func:`check_binding`: a console bound to anything but a loopback address refuses to
  start without an access token or basic-auth credentials.
* :class:`Access`: a request is authenticated by the token (``Authorization: Bearer``,
  or a session opened on the login page) or by basic auth; compared in constant time.
* :class:`Sessions`: one random session per browser (an ``HttpOnly``, ``SameSite=Strict``
  cookie), holding who signed in and the session's CSRF token; every action (a POST)
  must carry that token in its form.
* :data:`SECURITY_HEADERS`: a Content-Security-Policy with no script at all, no framing,
  forms posting only to the console itself.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import secrets
import threading
import time
from dataclasses import dataclass, field

from mqdedup.errors import ConfigurationError

SESSION_COOKIE = "mqdedup_console"
#: Sessions idle longer than this are forgotten (the browser signs in again).
SESSION_IDLE_SECONDS = 8 * 3600
#: The most sessions kept at once; the oldest go first.
MAX_SESSIONS = 1000

#: Sent with every response. No script runs on the console's pages (none is served);
#: styles come from the console's own stylesheet only.
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'none'; style-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def parse_basic_auth(text: str | None) -> tuple[str, str] | None:
    """``user:password`` -> ``(user, password)``; None for None or empty."""
    if not text:
        return None
    user, colon, password = text.partition(":")
    if not colon or not user or not password:
        raise ConfigurationError("basic-auth credentials must be 'user:password' (both non-empty)")
    return user, password


def check_binding(host: str, token: str | None, basic: tuple[str, str] | None) -> None:
    """Refuse a console reachable from other machines that nobody has to sign in to."""
    if is_loopback(host) or token or basic:
        return
    raise ConfigurationError(
        f"the console would listen on {host}, reachable from other machines, without "
        "credentials: pass --token (or MQDEDUP_CONSOLE_TOKEN) or --basic-auth user:password "
        "(or MQDEDUP_CONSOLE_BASIC_AUTH), or bind 127.0.0.1"
    )


@dataclass(frozen=True)
class Access:
    """Who may use the console: anyone on the machine (no credentials), a token holder,
    or the basic-auth user."""

    token: str | None = None
    basic: tuple[str, str] | None = None

    @property
    def open(self) -> bool:
        """No credentials configured (a console on loopback only)."""
        return not self.token and self.basic is None

    def authenticate(self, authorization: str | None) -> str | None:
        """The actor named by an ``Authorization`` header, or None if it proves nothing."""
        if not authorization:
            return None
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and self.check_token(value):
            return "token"
        if scheme.lower() == "basic" and self.basic is not None:
            try:
                decoded = base64.b64decode(value, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return None
            user, _, password = decoded.partition(":")
            # Both compared, always: the time taken does not say which one was wrong.
            user_ok = hmac.compare_digest(user.encode(), self.basic[0].encode())
            password_ok = hmac.compare_digest(password.encode(), self.basic[1].encode())
            if user_ok and password_ok:
                return user
        return None

    def check_token(self, candidate: str) -> bool:
        """True if ``candidate`` is the access token (constant-time)."""
        return bool(self.token) and hmac.compare_digest(
            candidate.encode(), str(self.token).encode()
        )


@dataclass
class Session:
    """One browser's session: who signed in (None: nobody yet) and its CSRF token."""

    ident: str
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    actor: str | None = None
    seen: float = field(default_factory=time.monotonic)


class Sessions:
    """The open sessions, in memory (a restart signs everybody out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def get(self, ident: str | None) -> Session | None:
        """The live session ``ident`` names, or None."""
        if not ident:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._sessions.get(ident)
            if session is None or now - session.seen > SESSION_IDLE_SECONDS:
                self._sessions.pop(ident, None)
                return None
            session.seen = now
            return session

    def new(self) -> Session:
        """A fresh session (no one signed in)."""
        session = Session(secrets.token_urlsafe(32))
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                oldest = min(self._sessions.values(), key=lambda s: s.seen)
                del self._sessions[oldest.ident]
            self._sessions[session.ident] = session
        return session

    def rotate(self, session: Session, actor: str) -> Session:
        """Sign ``actor`` in on a new session (a fixed session id cannot be planted)."""
        with self._lock:
            self._sessions.pop(session.ident, None)
        fresh = self.new()
        fresh.actor = actor
        return fresh


def csrf_ok(session: Session | None, submitted: str | None) -> bool:
    """True if a form's CSRF token is the session's (constant-time)."""
    if session is None or not submitted:
        return False
    return hmac.compare_digest(submitted.encode(), session.csrf.encode())


def cookie_header(session: Session, *, secure: bool = False) -> str:
    """The ``Set-Cookie`` value for ``session``: not readable by script, same-site only."""
    flags = "; Secure" if secure else ""
    return f"{SESSION_COOKIE}={session.ident}; Path=/; HttpOnly; SameSite=Strict{flags}"


def read_cookie(header: str | None) -> str | None:
    """The session id in a ``Cookie`` header, or None."""
    if not header:
        return None
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == SESSION_COOKIE:
            return value
    return None
