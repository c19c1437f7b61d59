"""HTTP ``Idempotency-Key`` for Django views: a repeat gets the stored response.

::

    from mqdedup.django import idempotent

    @csrf_exempt
    @require_POST
    @idempotent
    def place_order(request):
        order = Order.objects.create(...)
        outbox().publish(...)
        return JsonResponse({"order": order.pk}, status=201)

The same semantics as :mod:`mqdedup.fastapi` (the core is
:mod:`mqdedup.dedup.request_keys`): the key is claimed as the first statement of an
atomic block on ``MQDEDUP["DATABASE"]``, the view runs in that block, and its response
is stored with the claim before the block commits, so the order, its outbox rows and
the stored response commit together or not at all. A repeat after the commit gets the
stored response (with ``Idempotent-Replayed: true``); a repeat while the first is in
flight gets 409; the same key with another method, path, query or body gets 422; a
missing or malformed key gets 400 (``required=False``: no key, no idempotency). A view
that raises or answers 5xx stores nothing and leaves the key free for a retry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from django.db import transaction  # type: ignore[import-untyped]
from django.http import HttpRequest, HttpResponse  # type: ignore[import-untyped]

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
from mqdedup.django.conf import database_alias, table_prefix
from mqdedup.django.connection import session
from mqdedup.errors import ConfigurationError

View = TypeVar("View", bound=Callable[..., Any])
Caller = Callable[[Any], str]


def anonymous_or_user(request: Any) -> str:
    """The default caller: the authenticated user's primary key, else ``anonymous``."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    return "anonymous"


@overload
def idempotent(view: View) -> View: ...


@overload
def idempotent(
    *,
    required: bool = True,
    using: str | None = None,
    caller: Caller | None = None,
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
) -> Callable[[View], View]: ...


def idempotent(
    view: Any = None,
    *,
    required: bool = True,
    using: str | None = None,
    caller: Caller | None = None,
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
) -> Any:
    """Give a view ``Idempotency-Key`` handling (use as ``@idempotent`` or with options).

    ``caller(request)`` names whose keys these are (default: the logged-in user, else one
    shared ``anonymous`` space); ``using``: the database alias (default
    ``MQDEDUP["DATABASE"]``); ``stored_headers``: response headers replayed with the body.
    """

    def decorate(function: View) -> View:
        keys = _Keys(required, using, caller or anonymous_or_user, tuple(stored_headers))

        @functools.wraps(function)
        def keyed_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return keys.run(function, request, args, kwargs)

        return keyed_view  # type: ignore[return-value]

    return decorate(view) if view is not None else decorate


class _Keys:
    """The decorator's settings, and one request's run."""

    def __init__(
        self, required: bool, using: str | None, caller: Caller, stored_headers: tuple[str, ...]
    ) -> None:
        self.required = required
        self.using = using
        self.caller = caller
        self.stored_headers = stored_headers

    def run(
        self, view: Callable[..., Any], request: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        try:
            key = read_key(request.headers.get(HEADER), required=self.required)
        except IdempotencyKeyError as error:
            return django_response(error.answer)
        if key is None:
            return view(request, *args, **kwargs)
        keyed = KeyedRequest(
            caller_scope(self.caller(request)),
            key,
            request_fingerprint(
                request.method or "",
                request.path,
                request.body,
                request.META.get("QUERY_STRING", ""),
            ),
        )
        alias = database_alias(self.using)
        keys = RequestKeys(prefix=table_prefix(), stored_headers=self.stored_headers)
        with transaction.atomic(using=alias), session(alias) as keyed_session:
            with keyed_session.begin():  # a savepoint: the claim, first in the block
                claim = keys.claim(keyed_session, keyed)
            if claim.answer is not None:  # replay, 409 or 422: nothing to commit
                transaction.set_rollback(True, using=alias)
                return django_response(claim.answer)
            response = view(request, *args, **kwargs)
            with keyed_session.begin():
                stored = keys.store(keyed_session, keyed, stored_response(response))
            if not stored:  # 5xx: nothing stored, the key is free for a retry
                transaction.set_rollback(True, using=alias)
            return response


def stored_response(response: Any) -> StoredResponse:
    """What is kept of a Django response: status, headers, body (not streamed ones)."""
    if getattr(response, "streaming", False):
        raise ConfigurationError(
            "an @idempotent view must return a complete response, not a streaming one "
            "(its body is stored for repeats)"
        )
    return StoredResponse(
        int(response.status_code),
        tuple((str(name), str(value)) for name, value in response.items()),
        bytes(response.content),
    )


def django_response(stored: StoredResponse) -> HttpResponse:
    """A Django response from a stored (or generated) one."""
    response = HttpResponse(stored.body, status=stored.status)
    for name, value in stored.headers:
        response[name] = value
    return response
