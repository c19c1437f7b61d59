"""``Idempotency-Key`` for FastAPI endpoints that write through an ``AsyncSession``.

Two parts, used together::

    from fastapi import APIRouter
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from mqdedup import AsyncOutboxWriter
    from mqdedup.fastapi import Idempotency, IdempotentRoute

    idempotency = Idempotency(async_sessionmaker(engine), caller=current_user_id)
    # caller= is required: a dependency returning who is calling (the keys' scope), or
    # SHARED_SCOPE to share one key space among all callers (see its risk)
    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/orders", status_code=201)
    async def place_order(order: OrderIn, session: AsyncSession = idempotency.session):
        session.add(Order(...))                       # the endpoint's writes
        await AsyncOutboxWriter(session).publish(...)  # and its events, same transaction
        return {"id": ...}

* :attr:`Idempotency.session` is the endpoint's dependency: it reads the key (400 when
  missing or malformed), opens the session's transaction, claims the key as its first
  statement (:mod:`mqdedup.dedup.request_keys`), and hands the endpoint the session.
  A repeat never reaches the endpoint: it gets the stored response, a 409 (the first
  is in flight) or a 422 (another payload). After the endpoint it commits, or rolls
  back when the endpoint raised or answered 5xx (the key is free again). The session
  is guarded: the endpoint cannot commit or roll it back (that raises
  :class:`~mqdedup.dedup.request_keys.EndpointEndedTransactionError`; nothing commits).
* :class:`IdempotentRoute` (the router's ``route_class``) sees the endpoint's finished
  response *before* the dependency commits and stores it in that transaction, and turns
  the early answers into responses. The commit happens before the response is sent, so
  a client never sees a success that did not commit.

The dependency uses FastAPI's ``Depends(..., scope="function")``: its exit (the commit)
runs after the endpoint and before the response is sent. Semantics and the per-database
details: ``docs/http-idempotency.md``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncSession, AsyncSessionTransaction, async_sessionmaker
from starlette.responses import Response

from mqdedup.consumers.context import HandlerEndedTransactionError, guard_session, unguard_session
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.request_keys import (
    DEFAULT_STORED_HEADERS,
    DEFAULT_TTL,
    HEADER,
    SHARED_SCOPE,
    CallerUnknownError,
    EndpointEndedTransactionError,
    FingerprintMode,
    FormPart,
    IdempotencyKeyError,
    KeyedRequest,
    RequestKeys,
    SharedScope,
    StoredResponse,
    body_bytes,
    caller_scope,
    check_mode,
    form_fingerprint,
    is_form,
    problem,
    read_key_headers,
    request_fingerprint,
)
from mqdedup.dedup.request_keys import (
    ENDPOINT_ENDED_TRANSACTION as ENDED,
)
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Where the dependency leaves the request's pending key for the route (ASGI scope key).
_PENDING = "mqdedup.idempotency"
#: Set by the route: the dependency refuses to run without it (nothing would be stored).
_ROUTED = "mqdedup.idempotent_route"
#: The problem ``type`` of an endpoint response that cannot be stored (a streaming one).
RESPONSE_NOT_STORABLE = "urn:mqdedup:problem:response-not-storable"

Caller = Callable[..., Awaitable[str | None] | str | None]


class UnstorableResponseError(ConfigurationError):
    """The endpoint returned a response whose body cannot be stored (a streaming one)."""


class _Answer(Exception):  # noqa: N818  (control flow: the response to send instead)
    """Raised by the dependency to answer without running the endpoint."""

    def __init__(self, response: StoredResponse) -> None:
        super().__init__(response.status)
        self.response = response


@dataclass
class _Pending:
    """One request's claimed key, between the claim and the commit."""

    keys: RequestKeys
    session: AsyncSession
    request: KeyedRequest
    stored: bool = False
    failed: bool = False

    async def finish(self, response: Response) -> None:
        """Store the endpoint's response in the transaction (a 5xx: mark it failed)."""
        try:
            body = body_bytes(getattr(response, "body", None))
        except TypeError:
            raise UnstorableResponseError(
                f"an endpoint with an {HEADER} must return a complete response (a Pydantic "
                "model, a dict or list, or a Response whose body is bytes, bytearray or "
                f"memoryview), not a {type(response).__name__} (its body cannot be stored)"
            ) from None
        answer = StoredResponse(
            response.status_code,
            tuple(
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in response.headers.raw
            ),
            body,
        )
        self.stored = await self.session.run_sync(self.keys.store, self.request, answer)
        self.failed = not self.stored


async def _shared() -> SharedScope:
    return SHARED_SCOPE


class Idempotency:
    """The ``Idempotency-Key`` handling of a group of endpoints (one session factory).

    ``sessions``: the endpoints' ``async_sessionmaker``. ``caller`` (required): a FastAPI
    dependency returning who is calling (a user or API client id from your
    authentication); keys are scoped to it, so two callers' keys never meet. A request
    whose caller is None or empty gets 403. ``caller=SHARED_SCOPE`` instead shares one
    key space among all callers: any client sending another's key gets that client's
    stored response (only for unguessable keys from trusted clients, see
    :data:`~mqdedup.dedup.request_keys.SHARED_SCOPE`). ``required``: a request without a
    key is answered 400 (else it runs without dedup). ``prefix``: the mqdedup tables'
    prefix. ``stored_headers``: response headers stored and replayed (credentials,
    cookies, ``Date`` and hop-by-hop headers are refused). ``ttl``: how long a key
    answers its repeats (default 24 hours; None: until purged). ``fingerprint``: how
    the body counts when a key is repeated (``"bytes"``, or ``"json"`` for canonical
    JSON); see :mod:`mqdedup.dedup.request_fingerprints`.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        caller: Caller | SharedScope | None = None,
        required: bool = True,
        prefix: str = DEFAULT_PREFIX,
        stored_headers: tuple[str, ...] = DEFAULT_STORED_HEADERS,
        ttl: timedelta | None = DEFAULT_TTL,
        fingerprint: FingerprintMode = "bytes",
    ) -> None:
        if caller is None:
            raise ConfigurationError(
                "Idempotency(...) needs caller=: a dependency returning who is calling (e.g. "
                "the authenticated user's id), so that each caller's keys are its own; "
                "caller=SHARED_SCOPE (mqdedup.fastapi) shares one key space among all "
                "callers, where anyone who learns a key gets that caller's stored response"
            )
        if not isinstance(caller, SharedScope) and not callable(caller):
            raise ConfigurationError(
                f"caller= must be a dependency (a callable) or SHARED_SCOPE, not {caller!r}"
            )
        self.sessions = sessions
        self.required = required
        try:
            self.fingerprint = check_mode(fingerprint)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
        self.keys = RequestKeys(prefix, stored_headers, ttl)
        who = _shared if isinstance(caller, SharedScope) else caller
        #: The endpoint parameter's default: ``session: AsyncSession = idempotency.session``.
        #: A session in a transaction that begins with the key's claim and commits after
        #: the endpoint (with the stored response), or rolls back.
        self.session: Any = Depends(self._dependency(who), scope="function")

    def _dependency(self, caller: Callable[..., Any]) -> Callable[..., AsyncIterator[AsyncSession]]:
        async def keyed_session(
            request: Request,
            who: str | SharedScope | None = Depends(caller),  # noqa: B008 (FastAPI's idiom)
        ) -> AsyncIterator[AsyncSession]:
            if not request.scope.get(_ROUTED):
                raise ConfigurationError(
                    f"{request.url.path}: an endpoint using Idempotency.session needs "
                    "route_class=IdempotentRoute on its router (else no response is stored)"
                )
            try:
                key = read_key_headers(request.headers.getlist(HEADER), required=self.required)
                scope = caller_scope(who) if key is not None else ""
            except (IdempotencyKeyError, CallerUnknownError) as refusal:
                raise _Answer(refusal.answer) from None
            async with self.sessions() as session:
                if key is None:
                    async with session.begin():
                        yield session
                    return
                keyed = KeyedRequest(scope, key, await self._fingerprint(request))
                transaction = await session.begin()
                try:
                    claim = await session.run_sync(self.keys.claim, keyed)
                    if claim.answer is not None:
                        raise _Answer(claim.answer)
                    pending = _Pending(self.keys, session, keyed)
                    request.scope[_PENDING] = pending
                    guard_session(session.sync_session)  # the endpoint cannot end it
                    try:
                        yield session  # the endpoint runs; IdempotentRoute stores its response
                    finally:
                        unguard_session(session.sync_session)
                except BaseException:
                    await transaction.rollback()
                    raise
                await _end(transaction, pending)

        return keyed_session

    async def _fingerprint(self, request: Request) -> str:
        """The request's fingerprint (a form read by FastAPI already: from its parts)."""
        content_type = request.headers.get("content-type", "")
        path, query = request.url.path, request.url.query
        try:
            body = await request.body()
        except RuntimeError:  # the stream was consumed: FastAPI parsed the form
            if not is_form(content_type):
                raise
            form = await request.form()  # cached by Starlette: the parsed form
            parts = [await _form_part(name, value) for name, value in form.multi_items()]
            return form_fingerprint(request.method, path, parts, query, content_type)
        return request_fingerprint(
            request.method, path, body, query, content_type, mode=self.fingerprint
        )


async def _form_part(name: str, value: Any) -> FormPart:
    if isinstance(value, str):
        return FormPart.of(name, value.encode("utf-8"))
    content = await value.read()  # an UploadFile: read, then rewound for the endpoint
    await value.seek(0)
    return FormPart.of(name, content, value.filename or "", value.content_type or "")


async def _end(transaction: AsyncSessionTransaction, pending: _Pending) -> None:
    """Commit the claim, the endpoint's writes and the stored response, or roll back."""
    if pending.stored:
        await transaction.commit()
        return
    await transaction.rollback()
    if not pending.failed:
        raise ConfigurationError("the endpoint's response was not stored; nothing committed")
    log.info(
        "request failed, idempotency key released",
        extra={"scope": pending.request.scope, "key": pending.request.key},
    )


def _to_response(stored: StoredResponse) -> Response:
    response = Response(content=stored.body, status_code=stored.status)
    for name, value in stored.headers:
        if name.lower() != "content-length":
            response.headers.append(name, value)
    return response


class IdempotentRoute(APIRoute):
    """The route class of routers with ``Idempotency.session`` endpoints.

    Stores the endpoint's response in its transaction before the dependency commits,
    and sends the stored response / 400 / 409 / 422 of repeats. Routes without the
    dependency behave as usual.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The request handler, wrapped (see the class docstring)."""
        handler = super().get_route_handler()
        if not inspect.iscoroutinefunction(handler):  # pragma: no cover - FastAPI's are
            raise ConfigurationError("IdempotentRoute needs FastAPI's async route handler")

        async def keyed_handler(request: Request) -> Response:
            request.scope[_ROUTED] = True
            try:
                response = await handler(request)
            except _Answer as answer:
                return _to_response(answer.response)
            except HandlerEndedTransactionError:
                # Refused: the dependency rolls back when this returns (nothing stored).
                ended: _Pending | None = request.scope.pop(_PENDING, None)
                if ended is not None:
                    ended.failed = True
                error = EndpointEndedTransactionError(
                    f"{request.method} {request.url.path}: an endpoint using "
                    "Idempotency.session must not commit, roll back, close or begin its "
                    "session (the key, the endpoint's writes and its response commit "
                    "together after it); nothing was committed and the key is free"
                )
                log.error(str(error), exc_info=True)
                return _to_response(
                    problem(500, "Endpoint ended its transaction", str(error), ENDED)
                )
            pending: _Pending | None = request.scope.pop(_PENDING, None)
            if pending is not None:
                try:
                    await pending.finish(response)
                except UnstorableResponseError as unstorable:
                    # The dependency rolls back when this returns: nothing stored, key free.
                    pending.failed = True
                    detail = f"{request.method} {request.url.path}: {unstorable}"
                    log.error(detail)
                    return _to_response(
                        problem(500, "Response cannot be stored", detail, RESPONSE_NOT_STORABLE)
                    )
            return response

        return keyed_handler
