"""HTTP ``Idempotency-Key``: unique-key dedup with the stored response, for HTTP APIs.

A client that retries ``POST /orders`` after a timeout cannot know whether the first
attempt placed the order. With an ``Idempotency-Key`` header (semantics of the IETF
httpapi *Idempotency-Key* draft) the server answers every repeat of a key with the
response of the one attempt that committed, and never performs the effect twice.

The key is claimed in the same dedup table as the consumers' message ids
(``<prefix>processed_messages``; the *consumer name* is the key's scope, one per caller:
:func:`caller_scope`), as the first statement of the endpoint's own transaction; the
endpoint's writes, its outbox rows and the stored response (status, selected headers,
body, and a fingerprint of the request) commit together with the claim, or none of them
do. What a request gets:

=====================================================  ==========================================
request                                                answer
=====================================================  ==========================================
first use of a key (or of one older than its ttl)      the endpoint runs; a response < 500 is
                                                       stored with the claim and committed
repeat after that commit, same request                 the stored response, plus
                                                       ``Idempotent-Replayed: true``
repeat while the first is still in flight              409, at once (it never waits on the
                                                       uncommitted claim)
repeat asking for something else (fingerprint)         422, ``type`` :data:`KEY_REUSED`
key missing where required, malformed, or two keys     400
no caller identity (and no explicit shared scope)      403
the endpoint raises, or answers 5xx                    nothing stored: the transaction rolls
                                                       back, the key is free for a retry
=====================================================  ==========================================

Secure by default: keys are scoped to the caller (there is no implicit shared key space:
:data:`SHARED_SCOPE` must be asked for by name), headers that carry credentials or
describe one connection are never stored (:data:`NEVER_STORED_HEADERS`), and keys
expire after ``ttl`` (24 hours by default), after which the key may be claimed again.

This module is framework-agnostic and synchronous, over a SQLAlchemy ``Session`` in the
caller's transaction: :mod:`mqdedup.fastapi` calls it through ``AsyncSession.run_sync``,
the Django integration on a Session over Django's connection. The flow of one request::

    keys = RequestKeys()
    key = read_key(request.headers.get(HEADER), required=True)        # IdempotencyKeyError → 400
    keyed = KeyedRequest(caller_scope(user_id), key,                   # CallerUnknownError → 403
                         request_fingerprint(method, path, body, query, content_type))
    with session.begin():
        claim = keys.claim(session, keyed)
        if claim.answer is not None:        # a replay, 409 or 422: end without commit
            session.rollback(); return claim.answer
        response = endpoint(session)        # the endpoint's writes, in this transaction
        if not keys.store(session, keyed, response):
            session.rollback()              # 5xx: nothing stored, the key is free again
        return response

Retention: the claims are rows of the dedup table with ``processed_at`` set when the
key was claimed. A key older than its ``ttl`` is claimed again by the next request
(in place, atomically: :func:`mqdedup.db.dialects.claim_key_nowait`); ``mqdedup dedup
purge --older-than 1d`` removes old keys with the consumers' claims.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.orm import Session

from mqdedup.db import dialects
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.request_fingerprints import (
    FingerprintMode,
    FormPart,
    check_mode,
    form_fingerprint,
    is_form,
    request_fingerprint,
)
from mqdedup.dedup.store import DedupStore, utcnow
from mqdedup.errors import ConfigurationError

__all__ = [
    "DEFAULT_STORED_HEADERS",
    "DEFAULT_TTL",
    "ENDPOINT_ENDED_TRANSACTION",
    "HEADER",
    "KEY_REUSED",
    "NEVER_STORED_HEADERS",
    "REPLAYED_HEADER",
    "SHARED_SCOPE",
    "CallerUnknownError",
    "Claim",
    "EndpointEndedTransactionError",
    "FingerprintMode",
    "FormPart",
    "IdempotencyKeyError",
    "KeyState",
    "KeyedRequest",
    "RequestKeys",
    "SharedScope",
    "StoredResponse",
    "caller_scope",
    "check_mode",
    "check_stored_headers",
    "form_fingerprint",
    "is_form",
    "problem",
    "read_key",
    "read_key_headers",
    "request_fingerprint",
]

log = logging.getLogger(__name__)

#: The request header carrying the key.
HEADER = "Idempotency-Key"
#: Added to a stored response returned to a repeat.
REPLAYED_HEADER = "Idempotent-Replayed"
#: The longest key accepted (the dedup table's ``message_id`` is VARCHAR(255)).
MAX_KEY_LENGTH = 255
#: Scopes start with this, so they never meet a consumer name in the dedup table.
SCOPE_PREFIX = "http:"
#: A caller's scope: ``http:id:<caller>`` for ids that fit, ``http:sha256:<hex>`` for
#: longer ones; a literal id never starts a scope with ``http:sha256:``.
_LITERAL_SCOPE = f"{SCOPE_PREFIX}id:"
_HASHED_SCOPE = f"{SCOPE_PREFIX}sha256:"
_SHARED_SCOPE = f"{SCOPE_PREFIX}shared"
#: Response headers stored with the response by default (lower case).
DEFAULT_STORED_HEADERS = ("content-type", "location", "etag", "last-modified", "cache-control")
#: Headers never stored nor replayed: credentials, cookies, the time of one answer, and
#: hop-by-hop headers (one connection's; RFC 9110 §7.6.1). Asking for one in
#: ``stored_headers`` is refused at construction.
NEVER_STORED_HEADERS: Final = frozenset(
    {
        "set-cookie",
        "set-cookie2",
        "cookie",
        "authorization",
        "proxy-authorization",
        "proxy-authenticate",
        "www-authenticate",
        "date",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: How long a key is kept by default: 24 hours, as the IETF draft suggests and Stripe does.
DEFAULT_TTL = timedelta(hours=24)
#: Seconds a client should wait before repeating a request answered 409.
RETRY_AFTER_SECONDS = 1
#: RFC 9457 problem ``type`` of each answer the keys give (never ``about:blank``, so a
#: client tells a reused key from the framework's own validation errors).
KEY_INVALID = "urn:mqdedup:problem:idempotency-key-invalid"
KEY_IN_FLIGHT = "urn:mqdedup:problem:idempotency-key-in-flight"
KEY_REUSED = "urn:mqdedup:problem:idempotency-key-reused"
CALLER_UNKNOWN = "urn:mqdedup:problem:idempotency-caller-unknown"
REQUEST_TOO_LARGE = "urn:mqdedup:problem:request-too-large"
ENDPOINT_ENDED_TRANSACTION = "urn:mqdedup:problem:endpoint-ended-transaction"
_FORMAT = 2  # version of the stored JSON (1: fingerprints without length prefixes)
_BODY_TYPES = "bytes, bytearray or memoryview"


class SharedScope:
    """The type of :data:`SHARED_SCOPE` (use that constant)."""

    def __repr__(self) -> str:
        return "SHARED_SCOPE"


#: ``caller=SHARED_SCOPE``: every caller shares one key space (``http:shared``).
#: **Risk:** a client that learns or guesses another client's key gets that client's
#: stored response (its body: order details, tokens) by sending the same request, and
#: learns that the key exists by sending another one (422). Use it only when no caller
#: identity exists and the keys are unguessable random UUIDs from trusted clients.
SHARED_SCOPE: Final = SharedScope()


class KeyState(StrEnum):
    """What claiming a key found."""

    #: First use (or the key had expired): the endpoint runs in this transaction.
    NEW = "new"
    #: Committed before with the same request: its stored response is the answer.
    REPLAY = "replay"
    #: Claimed by a transaction still in flight: 409.
    IN_FLIGHT = "in flight"
    #: Committed before with another request: 422.
    MISMATCH = "mismatch"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """An HTTP response as stored with its key: status, selected headers, body bytes."""

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key.lower() == wanted), None)


@dataclass(frozen=True, slots=True)
class KeyedRequest:
    """One request's key in its scope, and the fingerprint of what the request asks for."""

    scope: str
    key: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Claim:
    """The outcome of :meth:`RequestKeys.claim`.

    ``answer`` is None for :attr:`KeyState.NEW` (run the endpoint); otherwise it is the
    response to send instead (the stored one marked replayed, a 409 or a 422) and the
    transaction must end without commit (nothing was written).
    """

    state: KeyState
    answer: StoredResponse | None = None


class IdempotencyKeyError(ValueError):
    """The request's key is missing or malformed; :attr:`answer` is the 400 to send."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.answer = problem(400, "Idempotency-Key missing or invalid", detail, KEY_INVALID)


class CallerUnknownError(ValueError):
    """A keyed request without a caller identity; :attr:`answer` is the 403 to send."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.answer = problem(403, "Idempotency-Key needs a caller", detail, CALLER_UNKNOWN)


class EndpointEndedTransactionError(ConfigurationError):
    """An endpoint (view) ended the transaction that holds its key (``commit()``,
    ``rollback()``, ...). The call was refused or the transaction rolled back: nothing
    was committed, and the key is free. Let the integration commit."""


def problem(status: int, title: str, detail: str, kind: str = "about:blank") -> StoredResponse:
    """An RFC 9457 ``application/problem+json`` response (what the errors here send)."""
    body = json.dumps({"type": kind, "title": title, "status": status, "detail": detail})
    headers: list[tuple[str, str]] = [("content-type", "application/problem+json")]
    if status == 409:
        headers.append(("retry-after", str(RETRY_AFTER_SECONDS)))
    return StoredResponse(status, tuple(headers), body.encode())


def too_large(detail: str) -> StoredResponse:
    """The 413 for a body the framework refuses to read (``detail`` names the setting)."""
    return problem(413, "Request body too large", detail, REQUEST_TOO_LARGE)


def read_key_headers(values: Sequence[str], *, required: bool) -> str | None:
    """The key of a request's ``Idempotency-Key`` header lines (all of them).

    More than one line is a 400: which key the client meant is unknown.
    """
    if len(values) > 1:
        raise IdempotencyKeyError(
            f"the request has {len(values)} {HEADER} headers; send exactly one key"
        )
    return read_key(values[0] if values else None, required=required)


def read_key(value: str | None, *, required: bool) -> str | None:
    """The key of an ``Idempotency-Key`` header value; None when absent and not required.

    The draft writes the key as a structured-field string (``"8e03978e-…"``, quoted);
    bare tokens (``8e03978e-…``, what most clients send) are accepted too. Raises
    :class:`IdempotencyKeyError` (a 400) for a missing required key, an empty one, one longer
    than :data:`MAX_KEY_LENGTH`, one with characters outside printable ASCII, and a
    list (a comma outside quotes: two header lines joined by the server, or a list value).
    """
    if value is None:
        if required:
            raise IdempotencyKeyError(f"this endpoint requires an {HEADER} header")
        return None
    key = value.strip()
    if key.startswith('"'):
        key = _sf_string(key)
    elif "," in key:
        raise IdempotencyKeyError(
            f"the {HEADER} is a list (two headers, or a comma-separated value); send one key"
        )
    if not key:
        raise IdempotencyKeyError(f"the {HEADER} header is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise IdempotencyKeyError(f"the {HEADER} is longer than {MAX_KEY_LENGTH} characters")
    if any(not (" " <= char <= "~") for char in key):
        raise IdempotencyKeyError(f"the {HEADER} must be printable ASCII")
    return key


def _sf_string(value: str) -> str:
    """The content of a structured-field string (RFC 8941 §3.3.3) filling all of ``value``."""
    chars: list[str] = []
    position = 1
    while position < len(value):
        char = value[position]
        if char == "\\" and position + 1 < len(value) and value[position + 1] in '"\\':
            chars.append(value[position + 1])
            position += 2
            continue
        if char == '"':
            rest = value[position + 1 :].strip()
            if rest.startswith(","):
                raise IdempotencyKeyError(f"the {HEADER} is a list; send one key")
            if rest:
                raise IdempotencyKeyError(f"the {HEADER} has text after its quoted key")
            return "".join(chars)
        chars.append(char)
        position += 1
    raise IdempotencyKeyError(f"the {HEADER} opens a quote it does not close")


def caller_scope(caller: str | SharedScope | None) -> str:
    """The scope of one caller's keys; no two callers' scopes are ever the same.

    ``http:id:<caller>`` for a caller id that fits the column, ``http:sha256:<hex of the
    id>`` for a longer one (a JWT subject, a URL; no literal id yields a scope starting
    so), ``http:shared`` for :data:`SHARED_SCOPE`. An empty or missing caller raises
    :class:`CallerUnknownError` (a 403): there is no implicit shared key space.
    """
    if isinstance(caller, SharedScope):
        return _SHARED_SCOPE
    if not isinstance(caller, str) or not caller:
        raise CallerUnknownError(
            f"a request with an {HEADER} needs an identified caller (its keys are scoped to "
            "it); authenticate, or the application must opt into a shared key space "
            "explicitly (caller=SHARED_SCOPE)"
        )
    scope = f"{_LITERAL_SCOPE}{caller}"
    if len(scope) > MAX_KEY_LENGTH:
        digest = hashlib.sha256(caller.encode("utf-8", "surrogatepass")).hexdigest()
        scope = f"{_HASHED_SCOPE}{digest}"
    return scope


def check_stored_headers(names: Iterable[str]) -> frozenset[str]:
    """The lower-case header names, or a ConfigurationError for one never stored."""
    if isinstance(names, str):
        raise ConfigurationError("stored_headers must be a collection of header names, not a str")
    wanted = frozenset(name.lower().strip() for name in names)
    refused = sorted(wanted & NEVER_STORED_HEADERS)
    if refused:
        raise ConfigurationError(
            f"stored_headers may not include {', '.join(refused)}: credentials, cookies, the "
            "date and hop-by-hop headers belong to one response and are never stored or "
            "replayed to a repeat (a cookie would reach whoever repeats the key)"
        )
    return wanted


def check_ttl(ttl: timedelta | None) -> timedelta | None:
    """``ttl`` if it is a positive timedelta or None (keys kept until purged)."""
    if ttl is not None and (not isinstance(ttl, timedelta) or ttl <= timedelta(0)):
        raise ConfigurationError(f"ttl must be a positive timedelta or None, not {ttl!r}")
    return ttl


def body_bytes(body: object) -> bytes:
    """A response body as bytes; a TypeError naming the accepted types for anything else."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, bytearray | memoryview):
        return bytes(body)
    raise TypeError(
        f"a stored response body must be {_BODY_TYPES} (a complete response), "
        f"not {type(body).__name__}"
    )


@dataclass
class RequestKeys:
    """Claims request keys and stores responses in the dedup table of ``prefix``.

    Every method runs in the caller's transaction (``session``): the claim must be its
    first statement, the response stored last before commit. ``stored_headers``: the
    response headers stored and replayed (none of :data:`NEVER_STORED_HEADERS`).
    ``ttl``: how long a key answers repeats; an older key is claimed again (None: until
    purged).
    """

    prefix: str = DEFAULT_PREFIX
    #: Response headers stored and replayed (case-insensitive).
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS
    ttl: timedelta | None = DEFAULT_TTL
    _store: DedupStore = field(init=False, repr=False)
    _keep: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._keep = check_stored_headers(self.stored_headers)
        self.ttl = check_ttl(self.ttl)
        self._store = DedupStore(self.prefix)

    def claim(self, session: Session, request: KeyedRequest) -> Claim:
        """Claim ``request``'s key in the transaction, without waiting for another one.

        A transaction in flight holding the key makes this answer 409 at once
        (PostgreSQL: a transaction-scoped advisory lock on the key; MariaDB: no lock
        wait; SQLite serialises writers, so there the repeat waits for the first one and
        gets its stored response; see ``dialects.claim_key_nowait``). A key older than
        ``ttl`` is claimed again in place (the same row, atomically).
        """
        table = schema(self.prefix).processed
        now = utcnow()
        expired_before = now - self.ttl if self.ttl is not None else None
        found = dialects.claim_key_nowait(
            session, table, request.scope, request.key, now, expired_before=expired_before
        )
        if found == "new":
            return Claim(KeyState.NEW)
        if found == "busy":
            return self._in_flight(request)
        stored = session.execute(
            select(table.c.result).where(
                table.c.consumer_name == request.scope, table.c.message_id == request.key
            )
        ).scalar_one_or_none()
        response = _decode(stored)
        if response is None:
            # Committed without a response: not written by this module (or purged mid-way).
            return self._in_flight(request)
        fingerprint, saved = response
        if fingerprint != request.fingerprint:
            log.info(
                "idempotency key reused with another request",
                extra={"scope": request.scope, "key": request.key},
            )
            return Claim(
                KeyState.MISMATCH,
                problem(
                    422,
                    "Idempotency-Key reused",
                    f"this {HEADER} was used for a different request (method, path, query, "
                    "content type or body); use a new key for a new request",
                    KEY_REUSED,
                ),
            )
        replayed = StoredResponse(
            saved.status, (*saved.headers, (REPLAYED_HEADER.lower(), "true")), saved.body
        )
        return Claim(KeyState.REPLAY, replayed)

    def store(self, session: Session, request: KeyedRequest, response: StoredResponse) -> bool:
        """Store ``response`` with the key claimed in this transaction; False for a 5xx.

        On False nothing was written and the caller must roll the transaction back: a
        failed request leaves its key free for the client's retry. Only the headers of
        ``stored_headers`` are kept (never one of :data:`NEVER_STORED_HEADERS`); the body
        is kept byte for byte.
        """
        if response.status >= 500:
            return False
        body = body_bytes(response.body)
        kept = tuple(
            (name.lower(), value)
            for name, value in response.headers
            if name.lower() in self._keep and name.lower() not in NEVER_STORED_HEADERS
        )
        self._store.save_results(
            session,
            request.scope,
            {
                request.key: _encode(
                    request.fingerprint, StoredResponse(response.status, kept, body)
                )
            },
        )
        return True

    @staticmethod
    def _in_flight(request: KeyedRequest) -> Claim:
        log.info(
            "idempotency key in flight",
            extra={"scope": request.scope, "key": request.key},
        )
        return Claim(
            KeyState.IN_FLIGHT,
            problem(
                409,
                "Request in progress",
                f"a request with this {HEADER} is still being processed; retry later",
                KEY_IN_FLIGHT,
            ),
        )


def _encode(fingerprint: str, response: StoredResponse) -> dict[str, Any]:
    """The JSON stored in the dedup row's ``result`` column.

    The body is text when it is UTF-8 without NUL (PostgreSQL's JSON cannot hold
    U+0000), else base64: either way the bytes come back exactly.
    """
    body: dict[str, str]
    try:
        text = response.body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        body = {"text": text}
    else:
        body = {"base64": base64.b64encode(response.body).decode("ascii")}
    return {
        "http": _FORMAT,
        "fingerprint": fingerprint,
        "status": response.status,
        "headers": [list(pair) for pair in response.headers],
        **body,
    }


def _decode(stored: Any) -> tuple[str, StoredResponse] | None:
    """``(fingerprint, response)`` of a stored result, None if it holds none."""
    if isinstance(stored, str):  # a JSON column read back as text (some drivers)
        try:
            stored = json.loads(stored)
        except ValueError:
            return None
    if not isinstance(stored, dict) or stored.get("http") not in (1, _FORMAT):
        return None
    if "base64" in stored:
        body = base64.b64decode(stored["base64"])
    else:
        body = str(stored.get("text", "")).encode("utf-8")
    headers = tuple((str(name), str(value)) for name, value in stored.get("headers", ()))
    return str(stored["fingerprint"]), StoredResponse(int(stored["status"]), headers, body)
