"""HTTP ``Idempotency-Key``: unique-key dedup with the stored response, for HTTP APIs.

A client that retries ``POST /orders`` after a timeout cannot know whether the first
attempt placed the order. With an ``Idempotency-Key`` header (semantics of the IETF
httpapi *Idempotency-Key* draft) the server answers every repeat of a key with the
response of the one attempt that committed, and never performs the effect twice.

The key is claimed in the same dedup table as the consumers' message ids
(``<prefix>processed_messages``; the *consumer name* is the key's scope, e.g.
``http:<caller>``), as the first statement of the endpoint's own transaction; the
endpoint's writes, its outbox rows and the stored response (status, selected headers,
body, and a fingerprint of the request) commit together with the claim, or none of them
do. What a request gets:

=====================================================  ==========================================
request                                                answer
=====================================================  ==========================================
first use of a key                                     the endpoint runs; a response < 500 is
                                                       stored with the claim and committed
repeat after that commit, same method, path, body      the stored response, plus
                                                       ``Idempotent-Replayed: true``
repeat while the first is still in flight              409, at once (it never waits on the
                                                       uncommitted claim)
repeat with another method, path or body               422
key missing where required                             400 (also for a malformed key)
the endpoint raises, or answers 5xx                    nothing stored: the transaction rolls
                                                       back, the key is free for a retry
=====================================================  ==========================================

This module is framework-agnostic and synchronous, over a SQLAlchemy ``Session`` in the
caller's transaction: :mod:`mqdedup.fastapi` calls it through ``AsyncSession.run_sync``,
the Django integration on a Session over Django's connection. The flow of one request::

    keys = RequestKeys()
    key = read_key(request.headers.get(HEADER), required=True)        # IdempotencyKeyError → 400
    keyed = KeyedRequest(caller_scope(user_id), key,
                         request_fingerprint(method, path, body))
    with session.begin():
        claim = keys.claim(session, keyed)
        if claim.answer is not None:        # a replay, 409 or 422: end without commit
            session.rollback(); return claim.answer
        response = endpoint(session)        # the endpoint's writes, in this transaction
        if not keys.store(session, keyed, response):
            session.rollback()              # 5xx: nothing stored, the key is free again
        return response

Retention: the claims are rows of the dedup table with ``processed_at`` set when the
key was claimed, so ``mqdedup dedup purge --older-than 7d`` removes old keys with the
consumers' claims (``--consumer http:<caller>`` for one scope). A key purged is a key
a client may use again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from mqdedup.db import dialects
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import DedupStore, utcnow

log = logging.getLogger(__name__)

#: The request header carrying the key.
HEADER = "Idempotency-Key"
#: Added to a stored response returned to a repeat.
REPLAYED_HEADER = "Idempotent-Replayed"
#: The longest key accepted (the dedup table's ``message_id`` is VARCHAR(255)).
MAX_KEY_LENGTH = 255
#: Scopes start with this, so they never meet a consumer name in the dedup table.
SCOPE_PREFIX = "http:"
#: Response headers stored with the response by default (lower case). ``Set-Cookie``,
#: ``Date``, ``Content-Length`` and hop-by-hop headers are never worth replaying.
DEFAULT_STORED_HEADERS = ("content-type", "location", "etag", "last-modified", "cache-control")
#: Seconds a client should wait before repeating a request answered 409.
RETRY_AFTER_SECONDS = 1
_FORMAT = 1  # version of the stored JSON


class KeyState(StrEnum):
    """What claiming a key found."""

    #: First use: the endpoint runs in this transaction.
    NEW = "new"
    #: Committed before with the same request: its stored response is the answer.
    REPLAY = "replay"
    #: Claimed by a transaction still in flight: 409.
    IN_FLIGHT = "in flight"
    #: Committed before with another method, path or body: 422.
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
        self.answer = problem(400, "Idempotency-Key missing or invalid", detail)


def problem(status: int, title: str, detail: str) -> StoredResponse:
    """An RFC 9457 ``application/problem+json`` response (what the errors here send)."""
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail})
    headers: list[tuple[str, str]] = [("content-type", "application/problem+json")]
    if status == 409:
        headers.append(("retry-after", str(RETRY_AFTER_SECONDS)))
    return StoredResponse(status, tuple(headers), body.encode())


def read_key(value: str | None, *, required: bool) -> str | None:
    """The key of an ``Idempotency-Key`` header value; None when absent and not required.

    The draft writes the key as a structured-field string (``"8e03978e-…"``, quoted);
    bare tokens (``8e03978e-…``, what most clients send) are accepted too. Raises
    :class:`IdempotencyKeyError` (a 400) for a missing required key, an empty one, one longer
    than :data:`MAX_KEY_LENGTH` or one with characters outside printable ASCII.
    """
    if value is None:
        if required:
            raise IdempotencyKeyError(f"this endpoint requires an {HEADER} header")
        return None
    key = value.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if not key:
        raise IdempotencyKeyError(f"the {HEADER} header is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise IdempotencyKeyError(f"the {HEADER} is longer than {MAX_KEY_LENGTH} characters")
    if any(not (" " <= char <= "~") for char in key):
        raise IdempotencyKeyError(f"the {HEADER} must be printable ASCII")
    return key


def caller_scope(caller: str) -> str:
    """The scope of one caller's keys (``http:<caller>``); keys of two callers never meet."""
    scope = f"{SCOPE_PREFIX}{caller}"
    if len(scope) > MAX_KEY_LENGTH:
        # Long caller identities (a JWT subject, a URL) still fit the VARCHAR(255) column.
        scope = f"{SCOPE_PREFIX}sha256:{hashlib.sha256(caller.encode()).hexdigest()}"
    return scope


def request_fingerprint(method: str, path: str, body: bytes, query: str = "") -> str:
    """What a key's request asked for: SHA-256 over method, path, query string and body.

    A repeat of the key must carry the same fingerprint, else it is answered 422.
    """
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), query.encode()):
        digest.update(part)
        digest.update(b"\x00")
    digest.update(body)
    return digest.hexdigest()


@dataclass
class RequestKeys:
    """Claims request keys and stores responses in the dedup table of ``prefix``.

    Every method runs in the caller's transaction (``session``): the claim must be its
    first statement, the response stored last before commit.
    """

    prefix: str = DEFAULT_PREFIX
    #: Response headers stored and replayed (case-insensitive).
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS
    _store: DedupStore = field(init=False, repr=False)
    _keep: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._store = DedupStore(self.prefix)
        self._keep = frozenset(name.lower() for name in self.stored_headers)

    def claim(self, session: Session, request: KeyedRequest) -> Claim:
        """Claim ``request``'s key in the transaction, without waiting for another one.

        A transaction in flight holding the key makes this answer 409 at once
        (PostgreSQL: a transaction-scoped advisory lock on the key; MariaDB: no lock
        wait; SQLite serialises writers, so there the repeat waits for the first one and
        gets its stored response; see ``dialects.claim_key_nowait``).
        """
        table = schema(self.prefix).processed
        found = dialects.claim_key_nowait(session, table, request.scope, request.key, utcnow())
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
                    f"this {HEADER} was used for a different request (method, path or body)",
                ),
            )
        replayed = StoredResponse(
            saved.status, (*saved.headers, (REPLAYED_HEADER.lower(), "true")), saved.body
        )
        return Claim(KeyState.REPLAY, replayed)

    def store(self, session: Session, request: KeyedRequest, response: StoredResponse) -> bool:
        """Store ``response`` with the key claimed in this transaction; False for a 5xx.

        On False nothing was written and the caller must roll the transaction back: a
        failed request leaves its key free for the client's retry.
        """
        if response.status >= 500:
            return False
        kept = tuple((name.lower(), value) for name, value in response.headers if self._keeps(name))
        self._store.save_results(
            session,
            request.scope,
            {
                request.key: _encode(
                    request.fingerprint, StoredResponse(response.status, kept, response.body)
                )
            },
        )
        return True

    def _keeps(self, name: str) -> bool:
        return name.lower() in self._keep

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
            ),
        )


def _encode(fingerprint: str, response: StoredResponse) -> dict[str, Any]:
    """The JSON stored in the dedup row's ``result`` column."""
    try:
        body: dict[str, str] = {"text": response.body.decode("utf-8")}
    except UnicodeDecodeError:
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
    if not isinstance(stored, dict) or stored.get("http") != _FORMAT:
        return None
    if "base64" in stored:
        body = base64.b64decode(stored["base64"])
    else:
        body = str(stored.get("text", "")).encode("utf-8")
    headers = tuple((str(name), str(value)) for name, value in stored.get("headers", ()))
    return str(stored["fingerprint"]), StoredResponse(int(stored["status"]), headers, body)
