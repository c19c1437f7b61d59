"""The console's guards, request by request (no socket, SQLite tables): binding refusal,
token and basic-auth sign-in, the CSRF check, read-only, the audit, escaping, masking and
truncation. Each "refused" case also checks that the rows did not change."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session

from mqdedup.cli.main import main
from mqdedup.console import ConsoleApp, ConsoleSettings
from mqdedup.console.deadletters import DeadLetterService
from mqdedup.console.html import show_body
from mqdedup.console.security import Access, check_binding, is_loopback, parse_basic_auth
from mqdedup.console.web import Request, Response
from mqdedup.db.engine import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.deadletters import DatabaseDeadLetters
from mqdedup.dedup.dead_letters import DeadLetterCause, DeadLetterTable
from mqdedup.errors import ConfigurationError
from mqdedup.message import Message

PREFIX = "mqdedup_"
TOKEN = "s3cret-token-value"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    bound = create_engine(f"sqlite:///{tmp_path / 'console.db'}")
    init_schema(bound, PREFIX)
    yield bound
    bound.dispose()


def _failed_row(engine: Engine) -> None:
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.execute(
            insert(schema(PREFIX).outbox).values(
                message_id="out-1",
                broker="kafka",
                destination="orders",
                shard_hash=0,
                headers=[],
                payload=b"{}",
                state="failed",
                attempts=5,
                last_error="broker said no",
                created_at=now,
                available_at=now,
            )
        )


def _state(engine: Engine) -> tuple[str, int]:
    tables = schema(PREFIX)
    with engine.connect() as connection:
        state = connection.execute(select(tables.outbox.c.state)).scalar_one()
        audited = connection.execute(select(func.count()).select_from(tables.audit)).scalar_one()
    return state, audited


def _app(engine: Engine, **options: object) -> ConsoleApp:
    settings = ConsoleSettings(
        engine=engine,
        prefix=PREFIX,
        dead_letters=DeadLetterService([DatabaseDeadLetters(engine, PREFIX)]),
        **options,  # type: ignore[arg-type]
    )
    return ConsoleApp(settings)


class Browser:
    """Keeps the session cookie between requests, as a browser does."""

    def __init__(self, app: ConsoleApp, headers: dict[str, str] | None = None) -> None:
        self.app = app
        self.cookie = ""
        self.headers = headers or {}

    def request(self, method: str, target: str, form: str = "", **headers: str) -> Response:
        sent = {"host": "127.0.0.1:8470", **self.headers, **headers}
        if self.cookie:
            sent["cookie"] = self.cookie
        response = self.app.handle(Request.parse(method, target, sent, form.encode(), "127.0.0.1"))
        if "Set-Cookie" in response.headers:
            self.cookie = response.headers["Set-Cookie"].split(";", 1)[0]
        return response

    def csrf(self, target: str = "/outbox/retry") -> str:
        page = self.request("GET", target).body.decode()
        match = re.search(r'name="csrf" value="([^"]+)"', page)
        assert match, page
        return match.group(1)


# -- binding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_credentials(host: str) -> None:
    assert is_loopback(host)
    check_binding(host, None, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "console.example"])
def test_binding_elsewhere_without_credentials_is_refused(host: str) -> None:
    with pytest.raises(ConfigurationError, match="--token"):
        check_binding(host, None, None)
    check_binding(host, "t", None)
    check_binding(host, None, ("u", "p"))


def test_the_command_refuses_to_start_exposed_without_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MQDEDUP_CONSOLE_TOKEN", raising=False)
    monkeypatch.delenv("MQDEDUP_CONSOLE_BASIC_AUTH", raising=False)
    code = main(["console", "--host", "0.0.0.0", "--database", "sqlite:///:memory:"])
    err = capsys.readouterr().err
    assert code == 3
    assert "reachable from other machines" in err and "Traceback" not in err


def test_malformed_basic_auth_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="user:password"):
        parse_basic_auth("no-colon")
    assert parse_basic_auth("ops:pw:with:colons") == ("ops", "pw:with:colons")


# -- sign-in ---------------------------------------------------------------------------------


def test_without_the_token_pages_ask_to_sign_in_and_actions_change_nothing(engine: Engine) -> None:
    _failed_row(engine)
    browser = Browser(_app(engine, access=Access(token=TOKEN)))
    page = browser.request("GET", "/outbox")
    assert page.status == 401 and b"broker said no" not in page.body
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.body.decode())
    assert csrf  # the sign-in form's token: valid for this session, but nobody signed in
    refused = browser.request("POST", "/outbox/retry", f"csrf={csrf.group(1)}")
    assert refused.status == 403
    assert _state(engine) == ("failed", 0)
    wrong = browser.request("GET", "/outbox", authorization="Bearer not-the-token")
    assert wrong.status == 401


def test_the_token_signs_in_by_header_or_by_the_form(engine: Engine) -> None:
    _failed_row(engine)
    app = _app(engine, access=Access(token=TOKEN))
    by_header = Browser(app, {"authorization": f"Bearer {TOKEN}"})
    assert by_header.request("GET", "/outbox").status == 200
    browser = Browser(app)
    csrf = browser.csrf("/login")
    before = browser.cookie
    assert browser.request("POST", "/login", f"csrf={csrf}&token=wrong").status == 403
    signed_in = browser.request("POST", "/login", f"csrf={csrf}&token={TOKEN}")
    assert signed_in.status == 303 and browser.cookie != before  # a fresh session id
    assert "HttpOnly" in signed_in.headers["Set-Cookie"]
    assert "SameSite=Strict" in signed_in.headers["Set-Cookie"]
    page = browser.request("GET", "/outbox")
    assert page.status == 200 and b"broker said no" in page.body
    assert TOKEN.encode() not in page.body


def test_basic_auth(engine: Engine) -> None:
    app = _app(engine, access=Access(basic=("ops", "pw")))
    anonymous = Browser(app).request("GET", "/")
    assert anonymous.status == 401 and "Basic" in anonymous.headers["WWW-Authenticate"]
    wrong = base64.b64encode(b"ops:nope").decode()
    assert Browser(app, {"authorization": f"Basic {wrong}"}).request("GET", "/").status == 401
    right = base64.b64encode(b"ops:pw").decode()
    assert Browser(app, {"authorization": f"Basic {right}"}).request("GET", "/").status == 200


# -- CSRF, read-only, audit -------------------------------------------------------------------


def test_an_action_without_the_sessions_csrf_token_changes_nothing(engine: Engine) -> None:
    _failed_row(engine)
    app = _app(engine)
    browser = Browser(app)
    browser.csrf()
    assert browser.request("POST", "/outbox/retry", "").status == 403
    assert browser.request("POST", "/outbox/retry", "csrf=forged").status == 403
    other = Browser(app)
    other_token = other.csrf()  # a valid token, of another session
    assert browser.request("POST", "/outbox/retry", f"csrf={other_token}").status == 403
    assert _state(engine) == ("failed", 0)


def test_a_cross_origin_post_changes_nothing(engine: Engine) -> None:
    _failed_row(engine)
    browser = Browser(_app(engine))
    csrf = browser.csrf()
    refused = browser.request("POST", "/outbox/retry", f"csrf={csrf}", origin="http://evil.example")
    assert refused.status == 403
    assert (
        browser.request(
            "POST", "/outbox/retry", f"csrf={csrf}", **{"sec-fetch-site": "cross-site"}
        ).status
        == 403
    )
    assert _state(engine) == ("failed", 0)


def test_a_confirmed_action_runs_once_and_is_audited(engine: Engine) -> None:
    _failed_row(engine)
    browser = Browser(_app(engine))
    csrf = browser.csrf()
    done = browser.request("POST", "/outbox/retry", f"csrf={csrf}", origin="http://127.0.0.1:8470")
    assert done.status == 200 and b"put 1 failed outbox row(s) back" in done.body
    assert _state(engine) == ("pending", 1)
    entry = schema(PREFIX).audit
    with engine.connect() as connection:
        row = connection.execute(select(entry)).one()
    assert (row.actor, row.action, row.messages) == ("local@127.0.0.1", "retry-outbox", 1)


def test_read_only_shows_no_action_and_refuses_posts(engine: Engine) -> None:
    _failed_row(engine)
    _park(engine, b"body")
    browser = Browser(_app(engine, read_only=True))
    for path in (
        "/",
        "/outbox",
        "/dead-letters",
        "/claims",
        "/audit",
        "/dead-letters/message?place=database&key=1",
    ):
        page = browser.request("GET", path)
        assert page.status == 200, path
        assert b'<form method="post"' not in page.body and b"Retry" not in page.body, path
        assert b"replay\xe2\x80\xa6" not in page.body and b"delete\xe2\x80\xa6" not in page.body
    # even a session's valid token (from the confirmation page) cannot act
    confirm = browser.request("GET", "/outbox/retry").body.decode()
    assert 'name="csrf"' not in confirm
    session = browser.app.sessions.get(browser.cookie.split("=", 1)[1])
    assert session is not None
    assert browser.request("POST", "/outbox/retry", f"csrf={session.csrf}").status == 403
    assert _state(engine) == ("failed", 0)


def test_every_response_carries_a_strict_policy(engine: Engine) -> None:
    for path in ("/", "/nope", "/static/console.css"):
        response = Browser(_app(engine)).request("GET", path)
        policy = response.headers["Content-Security-Policy"]
        assert "script-src 'none'" in policy and "default-src 'none'" in policy
        assert "unsafe-inline" not in policy
        assert response.headers["X-Frame-Options"] == "DENY"


# -- what pages show -------------------------------------------------------------------------


def _park(engine: Engine, body: bytes, headers: dict[str, str | bytes] | None = None) -> None:
    with Session(engine) as session, session.begin():
        DeadLetterTable(PREFIX).park(
            session,
            "orders",
            Message(body=body, id="m-1", headers=headers or {}, source="orders"),
            DeadLetterCause(
                "handler raised MessageError: <b>bad</b>", 3, "too large", "MessageError", "bad"
            ),
        )


def test_a_body_with_markup_is_shown_as_text(engine: Engine) -> None:
    _park(engine, b"<script>alert('x')</script><img src=x onerror=alert(1)>")
    page = Browser(_app(engine)).request("GET", "/dead-letters/message?place=database&key=1")
    text = page.body.decode()
    assert "<script>alert" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "&lt;b&gt;bad&lt;/b&gt;" in text  # the reason too
    listing = Browser(_app(engine)).request("GET", "/dead-letters").body.decode()
    assert "<b>bad</b>" not in listing


def test_secrets_in_headers_are_masked(engine: Engine) -> None:
    _park(
        engine,
        b"{}",
        {
            "x-callback": "https://app:hunter22@hooks.example/cb?token=abc123",
            "authorization": "Bearer abc.def",
            "x-plain": "visible",
        },
    )
    text = (
        Browser(_app(engine))
        .request("GET", "/dead-letters/message?place=database&key=1")
        .body.decode()
    )
    assert "hunter22" not in text and "abc123" not in text and "abc.def" not in text
    assert "https://app:***@hooks.example/cb?token=***" in text and "visible" in text


def test_a_body_over_the_limit_is_truncated_and_says_so(engine: Engine) -> None:
    body = b"a" * 5000 + b"TAIL"
    _park(engine, body)
    text = (
        Browser(_app(engine, body_limit=1000))
        .request("GET", "/dead-letters/message?place=database&key=1")
        .body.decode()
    )
    assert "truncated: showing the first 1,000 of 5,004 bytes" in text
    assert "a" * 1000 in text and "a" * 1001 not in text and "TAIL" not in text
    assert "truncated" not in show_body(b"short", 1000)
