"""The console's requests and answers: routing, sign-in, the CSRF check, the audit.

:class:`ConsoleApp` turns a :class:`Request` into a :class:`Response` without touching a
socket (the unit tests call it directly); :mod:`mqdedup.console.server` serves it. Every
GET only reads. Every action is a POST that must come from a signed-in session, carry
that session's CSRF token and, when the browser says where it comes from (``Origin``,
``Sec-Fetch-Site``), come from the console itself; with ``read_only`` every POST but
the sign-in is refused and no page shows an action. Each action is confirmed on a page
of its own (a GET that says what will happen) and written to ``<prefix>audit``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from mqdedup.console import pages
from mqdedup.console.html import Html, tag
from mqdedup.console.security import (
    SECURITY_HEADERS,
    Sessions,
    cookie_header,
    csrf_ok,
    read_cookie,
)
from mqdedup.console.static import STYLESHEET
from mqdedup.console.web import (
    ConsoleSettings,
    Context,
    ForbiddenError,
    Request,
    Response,
    document,
)
from mqdedup.errors import MqdedupError
from mqdedup.masking import mask_text

log = logging.getLogger(__name__)


Handler = Callable[[ConsoleSettings, Context], Response]


class ConsoleApp:
    """Routes requests to the pages and actions."""

    def __init__(self, settings: ConsoleSettings) -> None:
        self.settings = settings
        self.sessions = Sessions()

    # -- entry -------------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        """Answer one request (never raises)."""
        try:
            context = self._context(request)
            response = self._route(context)
            if context.new_cookie:
                response.headers["Set-Cookie"] = cookie_header(
                    context.session, secure=self.settings.secure_cookie
                )
        except ForbiddenError as refused:
            response = self.html(403, "ForbiddenError", tag("p", str(refused), class_="error"))
        except MqdedupError as exc:
            response = self.html(
                400, "Cannot do that", tag("p", mask_text(str(exc)), class_="error")
            )
        except Exception:
            log.exception("console request failed", extra={"path": request.path})
            response = self.html(
                500, "Error", tag("p", "the console failed; see its log", class_="error")
            )
        response.headers.update(SECURITY_HEADERS)
        return response

    def _context(self, request: Request) -> Context:
        session = self.sessions.get(read_cookie(request.headers.get("cookie")))
        new_cookie = session is None
        if session is None:
            session = self.sessions.new()
        access = self.settings.access
        actor = (
            "local"
            if access.open
            else session.actor or access.authenticate(request.headers.get("authorization"))
        )
        return Context(request, session, actor, new_cookie)

    def _route(self, context: Context) -> Response:
        request = context.request
        if request.path == "/static/console.css":
            return Response(200, STYLESHEET.encode(), "text/css; charset=utf-8")
        if request.path == "/favicon.ico":
            return Response(404, b"", "text/plain")
        if request.path == "/login":
            return pages.login(self.settings, self.sessions, context)
        if context.actor is None:
            return self._unauthenticated(context)
        routes = POST_ROUTES if request.method == "POST" else GET_ROUTES
        handler = routes.get(request.path)
        if handler is None:
            if request.method not in ("GET", "POST"):
                return self.html(405, "Method not allowed", tag("p", request.method))
            return self.html(404, "Not found", tag("p", "no such page"))
        if request.method == "POST":
            self._check_action(context)
        return handler(self.settings, context)

    def _unauthenticated(self, context: Context) -> Response:
        if context.request.method == "POST":
            raise ForbiddenError("sign in first: this action needs the console's token or password")
        if self.settings.access.token:
            return pages.login_form(self.settings, context, status=401)
        return Response(
            401,
            b"sign in required\n",
            "text/plain; charset=utf-8",
            {"WWW-Authenticate": 'Basic realm="mqdedup console", charset="UTF-8"'},
        )

    def _check_action(self, context: Context) -> None:
        request = context.request
        if self.settings.read_only:
            raise ForbiddenError("the console runs with --read-only: no action is allowed")
        if not csrf_ok(context.session, request.arg("csrf")):
            raise ForbiddenError(
                "the form's CSRF token is missing or not this session's: reload the page "
                "and try again"
            )
        if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            raise ForbiddenError("cross-site request refused")
        origin = request.headers.get("origin")
        host = request.headers.get("host")
        if origin and origin != "null" and host and urlsplit(origin).netloc != host:
            raise ForbiddenError("cross-origin request refused")

    def html(self, status: int, title: str, body: Html) -> Response:
        """A whole page."""
        return document(self.settings, status, title, body)


GET_ROUTES: dict[str, Handler] = {
    "/": pages.overview,
    "/claims": pages.claims,
    "/claims/forget": pages.confirm_forget,
    "/outbox": pages.outbox,
    "/outbox/retry": pages.confirm_retry,
    "/audit": pages.audit_page,
    "/dead-letters": pages.dead_letters,
    "/dead-letters/message": pages.dead_letter,
    "/dead-letters/confirm": pages.confirm_dead_letters,
}
POST_ROUTES: dict[str, Handler] = {
    "/claims/forget": pages.forget,
    "/outbox/retry": pages.retry,
    "/dead-letters/act": pages.act_on_dead_letters,
}
