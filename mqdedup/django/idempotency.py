"""HTTP ``Idempotency-Key`` for Django views: a repeat gets the stored response.

::

    from mqdedup.django import idempotent

    @require_POST
    @idempotent
    def place_order(request):
        order = Order.objects.create(...)
        outbox().publish(...)
        return JsonResponse({"order": order.pk}, status=201)

The same semantics as :mod:`mqdedup.fastapi` (the core is
:mod:`mqdedup.dedup.request_keys`): the key is claimed as the first statement of an
atomic block on ``MQDEDUP["DATABASE"]``, the view runs in that block, and its response
(a ``TemplateResponse`` rendered first) is stored with the claim before the block
commits, so the order, its outbox rows and the stored response commit together or not
at all. A repeat after the commit gets the stored response (with
``Idempotent-Replayed: true``); a repeat while the first is in flight gets 409; the same
key with another request gets 422; a missing, malformed or repeated key gets 400
(``required=False``: no key, no idempotency). A view that raises or answers 5xx stores
nothing and leaves the key free for a retry.

The keys are the authenticated user's (``request.user``); an anonymous request with a
key gets 403 unless the view names another scope (``caller=``) or opts into one shared
key space by name (``caller=SHARED_SCOPE``). Form posts (``multipart/form-data``,
CSRF-protected or not, with uploads within Django's limits) are fingerprinted from
Django's parsed ``request.POST`` / ``request.FILES``; a body beyond Django's limits gets
a 413 naming the setting.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar, overload

from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import (  # type: ignore[import-untyped]
    RequestDataTooBig,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.db import transaction  # type: ignore[import-untyped]
from django.db.transaction import TransactionManagementError  # type: ignore[import-untyped]
from django.http import HttpRequest, HttpResponse  # type: ignore[import-untyped]

from mqdedup.dedup.request_fingerprints import media_type
from mqdedup.dedup.request_keys import (
    DEFAULT_STORED_HEADERS,
    DEFAULT_TTL,
    HEADER,
    CallerUnknownError,
    EndpointEndedTransactionError,
    FingerprintMode,
    FormPart,
    IdempotencyKeyError,
    KeyedRequest,
    RequestKeys,
    SharedScope,
    StoredResponse,
    caller_scope,
    check_mode,
    check_stored_headers,
    check_ttl,
    form_fingerprint,
    is_form,
    read_key,
    request_fingerprint,
    too_large,
)
from mqdedup.django.conf import database_alias, table_prefix
from mqdedup.django.connection import session
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)
View = TypeVar("View", bound=Callable[..., Any])
Caller = Callable[[Any], str | None]
#: What each of Django's refusals to read a body is limited by (the setting to raise).
_LIMITS = (
    (RequestDataTooBig, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
    (TooManyFieldsSent, "DATA_UPLOAD_MAX_NUMBER_FIELDS"),
    (TooManyFilesSent, "DATA_UPLOAD_MAX_NUMBER_FILES"),
)


def authenticated_user(request: Any) -> str | None:
    """The default caller: ``user:<pk>`` of the authenticated user, else None (→ 403)."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    return None


@overload
def idempotent(view: View) -> View: ...


@overload
def idempotent(
    *,
    required: bool = True,
    using: str | None = None,
    caller: Caller | SharedScope | None = None,
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
    ttl: timedelta | None = DEFAULT_TTL,
    fingerprint: FingerprintMode = "bytes",
) -> Callable[[View], View]: ...


def idempotent(
    view: Any = None,
    *,
    required: bool = True,
    using: str | None = None,
    caller: Caller | SharedScope | None = None,
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
    ttl: timedelta | None = DEFAULT_TTL,
    fingerprint: FingerprintMode = "bytes",
) -> Any:
    """Give a view ``Idempotency-Key`` handling (use as ``@idempotent`` or with options).

    ``caller(request)`` names whose keys these are (default: the authenticated user;
    None or an empty id: 403); ``caller=SHARED_SCOPE`` shares one key space among all
    callers (anyone who learns a key gets that response: see its risk). ``using``: the
    database alias (default ``MQDEDUP["DATABASE"]``); ``stored_headers``: response
    headers replayed with the body (never credentials, cookies, ``Date`` or hop-by-hop
    headers: refused here); ``ttl``: how long a key answers its repeats (default 24
    hours; None: until purged); ``fingerprint``: ``"bytes"`` or ``"json"`` (canonical
    JSON bodies).
    """
    try:
        mode = check_mode(fingerprint)
    except ValueError as error:
        raise ConfigurationError(str(error)) from None
    keys = _Keys(
        required,
        using,
        caller or authenticated_user,
        tuple(check_stored_headers(stored_headers)),
        check_ttl(ttl),
        mode,
    )

    def decorate(function: View) -> View:
        @functools.wraps(function)
        def keyed_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return keys.run(function, request, args, kwargs)

        return keyed_view  # type: ignore[return-value]

    return decorate(view) if view is not None else decorate


class _Keys:
    """The decorator's settings, and one request's run."""

    def __init__(
        self,
        required: bool,
        using: str | None,
        caller: Caller | SharedScope,
        stored_headers: tuple[str, ...],
        ttl: timedelta | None,
        fingerprint: FingerprintMode,
    ) -> None:
        self.required = required
        self.using = using
        self.caller = caller
        self.stored_headers = stored_headers
        self.ttl = ttl
        self.fingerprint = fingerprint

    def run(
        self, view: Callable[..., Any], request: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        try:
            # WSGI servers join repeated header lines with commas: a list is refused.
            key = read_key(request.headers.get(HEADER), required=self.required)
            if key is None:
                return view(request, *args, **kwargs)
            who = self.caller if isinstance(self.caller, SharedScope) else self.caller(request)
            keyed = KeyedRequest(caller_scope(who), key, self._fingerprint(request))
        except (IdempotencyKeyError, CallerUnknownError) as error:
            return django_response(error.answer)
        except _TooLarge as error:
            log.info("keyed request beyond Django's limits", extra={"setting": error.setting})
            return django_response(error.answer)
        alias = database_alias(self.using)
        keys = RequestKeys(table_prefix(), self.stored_headers, self.ttl)
        with transaction.atomic(using=alias), session(alias) as keyed_session:
            with keyed_session.begin():  # a savepoint: the claim, first in the block
                claim = keys.claim(keyed_session, keyed)
            if claim.answer is not None:  # replay, 409 or 422: nothing to commit
                transaction.set_rollback(True, using=alias)
                return django_response(claim.answer)
            try:
                response = _rendered(view(request, *args, **kwargs))
            except TransactionManagementError as error:
                raise EndpointEndedTransactionError(
                    f"{request.method} {request.path}: an @idempotent view must not end or "
                    f"break the transaction that holds its key ({error}); nothing was "
                    "committed and the key is free"
                ) from error
            with keyed_session.begin():
                stored = keys.store(keyed_session, keyed, stored_response(response))
            if not stored:  # 5xx: nothing stored, the key is free for a retry
                transaction.set_rollback(True, using=alias)
            return response

    def _fingerprint(self, request: Any) -> str:
        """The request's fingerprint; a form from Django's parsed fields and files (never
        ``request.body``, which a CSRF check or a large upload makes unreadable)."""
        content_type = request.META.get("CONTENT_TYPE", "")
        query = request.META.get("QUERY_STRING", "")
        method = request.method or ""
        try:
            if is_form(content_type):
                return form_fingerprint(
                    method, request.path, _form_parts(request), query, content_type
                )
            return request_fingerprint(
                method, request.path, request.body, query, content_type, mode=self.fingerprint
            )
        except (RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent) as error:
            setting = next(name for kind, name in _LIMITS if isinstance(error, kind))
            limit = getattr(settings, setting, None)
            raise _TooLarge(
                setting,
                too_large(
                    f"the request is beyond Django's {setting} (now {limit}); the "
                    "application may raise that setting"
                ),
            ) from None


class _TooLarge(Exception):  # noqa: N818  (control flow: the 413 to send)
    def __init__(self, setting: str, answer: StoredResponse) -> None:
        super().__init__(setting)
        self.setting = setting
        self.answer = answer


def _form_parts(request: Any) -> list[FormPart]:
    parts = [
        FormPart.of(name, value.encode("utf-8"))
        for name, values in request.POST.lists()
        for value in values
    ]
    for name, files in request.FILES.lists():
        for upload in files:
            digest = hashlib.sha256()
            for chunk in upload.chunks():
                digest.update(chunk)
            upload.seek(0)  # the view reads it from the start
            parts.append(
                FormPart(
                    name, upload.name or "", digest.digest(), media_type(upload.content_type or "")
                )
            )
    return parts


def _rendered(response: Any) -> Any:
    """A ``TemplateResponse`` (DRF's ``Response`` too) rendered, in the key's transaction."""
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        response = render()
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
