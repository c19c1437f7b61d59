"""Views of the key tests' Django project: each run writes one ``<prefix>effects`` row."""

import hashlib
import json
import secrets
import threading
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AnonymousUser, User
from django.db import connection, transaction
from django.http import HttpResponse, JsonResponse
from django.template.response import SimpleTemplateResponse, TemplateResponse
from django.views.decorators.csrf import csrf_exempt

from mqdedup.django import SHARED_SCOPE, idempotent
from tests.integration.http.servers import BODIES

_releases: dict[str, threading.Event] = {}
_lock = threading.Lock()


class HeaderUser:
    """``X-User: <pk>`` authenticates as that user (a stand-in for real authentication)."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        user = request.headers.get("X-User")
        request.user = User(pk=int(user), username=f"u{user}") if user else AnonymousUser()
        return self.get_response(request)


def effect(request: Any, kind: str, detail: str = "") -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {settings.PREFIX}effects (kind, caller, detail) VALUES (%s, %s, %s)",
            [kind, str(request.user.pk or "-"), detail[:400]],
        )


def _event(tag: str) -> threading.Event:
    with _lock:
        return _releases.setdefault(tag, threading.Event())


@csrf_exempt
@idempotent
def orders(request: Any) -> Any:
    data = json.loads(request.body)
    effect(request, "order", data["item"])
    if data["item"].startswith("hold-"):
        assert _event(data["item"][5:]).wait(60)
    token = f"tok_{secrets.token_hex(8)}"
    response = JsonResponse({"item": data["item"], "card_token": token}, status=201)
    response.set_cookie("session", token)
    return response


def _form_answer(request: Any, kind: str) -> Any:
    upload = request.FILES["upload"]
    digest = hashlib.sha256(upload.read()).hexdigest()
    effect(request, kind, f"{request.POST['note']}|{upload.size}|{digest}")
    return JsonResponse(
        {"note": request.POST["note"], "size": upload.size, "n": secrets.token_hex(4)}, status=201
    )


@idempotent
def form(request: Any) -> Any:  # CSRF-protected: the middleware reads request.POST first
    return _form_answer(request, "form")


@csrf_exempt
@idempotent
def upload(request: Any) -> Any:
    return _form_answer(request, "upload")


@csrf_exempt
@idempotent
def template(request: Any) -> Any:
    effect(request, "template")
    return TemplateResponse(request, "order.html", {"n": secrets.token_hex(4)})


@csrf_exempt
@idempotent
def simple_template(request: Any) -> Any:
    effect(request, "simple-template")
    return SimpleTemplateResponse("order.html", {"n": secrets.token_hex(4)})


@csrf_exempt
@idempotent
def binary(request: Any, kind: str) -> Any:
    effect(request, "binary", kind)
    return HttpResponse(BODIES[kind], content_type="application/octet-stream")


@csrf_exempt
@idempotent
def commits(request: Any) -> Any:
    effect(request, "commits")
    transaction.commit()  # misuse: @idempotent's atomic block owns the transaction
    return JsonResponse({"committed": "by the view"})


@csrf_exempt
@idempotent(caller=SHARED_SCOPE)
def shared(request: Any) -> Any:
    effect(request, "shared")
    return JsonResponse({"n": secrets.token_hex(4)}, status=201)


@csrf_exempt
def release(request: Any, tag: str) -> Any:
    _event(tag).set()
    return JsonResponse({"released": True})


def ready(request: Any) -> Any:
    return JsonResponse({"ready": True})
