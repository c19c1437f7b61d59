"""``Idempotency-Key`` for FastAPI endpoints that write through an ``AsyncSession``.

Two parts, used together::

    from fastapi import APIRouter, Depends
    from sqlalchemy.ext.asyncio import AsyncSession, AsyncSessionTransaction, async_sessionmaker
    from mqdedup.fastapi import Idempotency, IdempotentRoute

    idempotency = Idempotency(async_sessionmaker(engine), caller=current_user_id)
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
  back when the endpoint raised or answered 5xx (the key is free again).
* :class:`IdempotentRoute` (the router's ``route_class``) sees the endpoint's finished
  response *before* the dependency commits and stores it in that transaction, and turns
  the early answers into responses. The commit happens before the response is sent, so
  a client never sees a success that did not commit.

The dependency uses FastAPI's ``Depends(..., scope="function")``: its exit (the commit)
runs after the endpoint and before the response is sent.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncSession, AsyncSessionTransaction, async_sessionmaker
from starlette.responses import Response

from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.request_keys import (
    DEFAULT_STORED_HEADERS,
    HEADER,
    IdempotencyKeyError,
    KeyedRequest,
    RequestKeys,
    StoredResponse,
    caller_scope,
    read_key,
    request_fingerprint,
)
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Where the dependency leaves the request's pending key for the route (ASGI scope key).
_PENDING = "mqdedup.idempotency"
#: Set by the route: the dependency refuses to run without it (nothing would be stored).
_ROUTED = "mqdedup.idempotent_route"

Caller = Callable[..., str | Awaitable[str]]


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
        body = getattr(response, "body", None)
        if not isinstance(body, bytes):
            raise ConfigurationError(
                f"an endpoint with an {HEADER} must return a complete response, "
                f"not a {type(response).__name__} (its body cannot be stored)"
            )
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


async def _anonymous() -> str:
    return "anonymous"


class Idempotency:
    """The ``Idempotency-Key`` handling of a group of endpoints (one session factory).

    ``sessions``: the endpoints' ``async_sessionmaker``. ``caller``: a FastAPI dependency
    returning who is calling (a user or client id from your authentication); keys are
    scoped to it (``http:<caller>``), so two callers' keys never meet. Without it every
    caller shares one key space (``http:anonymous``): fine for random UUID keys from
    trusted clients only. ``required``: a request without a key is answered 400 (else
    it runs without dedup). ``prefix``: the mqdedup tables' prefix. ``stored_headers``:
    response headers stored and replayed.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        caller: Caller | None = None,
        required: bool = True,
        prefix: str = DEFAULT_PREFIX,
        stored_headers: tuple[str, ...] = DEFAULT_STORED_HEADERS,
    ) -> None:
        self.sessions = sessions
        self.required = required
        self.keys = RequestKeys(prefix, stored_headers)
        #: The endpoint parameter's default: ``session: AsyncSession = idempotency.session``.
        #: A session in a transaction that begins with the key's claim and commits after
        #: the endpoint (with the stored response), or rolls back.
        self.session: Any = Depends(self._dependency(caller or _anonymous), scope="function")

    def _dependency(self, caller: Caller) -> Callable[..., AsyncIterator[AsyncSession]]:
        async def keyed_session(
            request: Request, who: str = Depends(caller)
        ) -> AsyncIterator[AsyncSession]:
            if not request.scope.get(_ROUTED):
                raise ConfigurationError(
                    f"{request.url.path}: an endpoint using Idempotency.session needs "
                    "route_class=IdempotentRoute on its router (else no response is stored)"
                )
            try:
                key = read_key(request.headers.get(HEADER), required=self.required)
            except IdempotencyKeyError as problem:
                raise _Answer(problem.answer) from None
            async with self.sessions() as session:
                if key is None:
                    async with session.begin():
                        yield session
                    return
                keyed = KeyedRequest(
                    caller_scope(who),
                    key,
                    request_fingerprint(
                        request.method, request.url.path, await request.body(), request.url.query
                    ),
                )
                transaction = await session.begin()
                try:
                    claim = await session.run_sync(self.keys.claim, keyed)
                    if claim.answer is not None:
                        raise _Answer(claim.answer)
                    pending = _Pending(self.keys, session, keyed)
                    request.scope[_PENDING] = pending
                    yield session  # the endpoint runs; IdempotentRoute stores its response
                except BaseException:
                    await transaction.rollback()
                    raise
                await _end(transaction, pending)

        return keyed_session


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
            pending: _Pending | None = request.scope.pop(_PENDING, None)
            if pending is not None:
                await pending.finish(response)
            return response

        return keyed_handler
