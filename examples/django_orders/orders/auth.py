"""API authentication of the example: ``Authorization: Bearer <token>`` names a user.

A token is the user's id signed with ``SECRET_KEY`` (:func:`token_for`; a real service
hands tokens out at login, or uses its auth library's). The middleware sets
``request.user``, which ``@idempotent`` scopes each caller's ``Idempotency-Key`` to: a
client sending another's key gets an order of its own, never the other's response.
Requests without a valid token stay anonymous (``@idempotent`` answers them 403).
"""

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser
from django.core import signing

_SALT = "orders.api-token"


def token_for(user: Any) -> str:
    """The bearer token of ``user``."""
    return signing.dumps(user.pk, salt=_SALT)


class BearerTokenMiddleware:
    """``request.user`` from a signed bearer token (anonymous without a valid one)."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        request.user = AnonymousUser()
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token:
            try:
                pk = signing.loads(token, salt=_SALT)
            except signing.BadSignature:
                pk = None
            user = get_user_model().objects.filter(pk=pk, is_active=True).first()
            if user is not None:
                request.user = user
        return self.get_response(request)
