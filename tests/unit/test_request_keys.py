"""HTTP idempotency keys on SQLite: the answers, stored responses, failures, purge."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select, update
from sqlalchemy.orm import Session

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.request_fingerprints import form_fingerprint, parse_form
from mqdedup.dedup.request_keys import (
    REPLAYED_HEADER,
    SHARED_SCOPE,
    CallerUnknownError,
    IdempotencyKeyError,
    KeyedRequest,
    KeyState,
    RequestKeys,
    StoredResponse,
    caller_scope,
    read_key,
    read_key_headers,
    request_fingerprint,
)
from mqdedup.dedup.store import DedupStore, utcnow
from mqdedup.errors import ConfigurationError
from tests.support import business, orders


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    init_schema(engine)
    business.create_all(engine)
    yield engine
    engine.dispose()


def keyed(key: str = "k-1", body: bytes = b'{"amount": 5}', caller: str = "alice") -> KeyedRequest:
    return KeyedRequest(caller_scope(caller), key, request_fingerprint("POST", "/orders", body))


CREATED = StoredResponse(
    201,
    (
        ("Content-Type", "application/json"),
        ("Location", "/orders/1"),
        ("Set-Cookie", "session=secret"),
    ),
    b'{"order": 1}',
)


def place(
    engine: Engine,
    keys: RequestKeys,
    request: KeyedRequest,
    response: StoredResponse,
    *,
    fail: bool = False,
) -> StoredResponse:
    """One keyed request the way an integration runs it: claim, write, store, commit."""
    with Session(engine) as session, session.begin():
        claim = keys.claim(session, request)
        if claim.answer is not None:
            session.rollback()
            return claim.answer
        session.execute(insert(orders).values(message_id=request.key, amount=1))
        if fail:
            raise RuntimeError("endpoint failed")
        if not keys.store(session, request, response):
            session.rollback()
        return response


def order_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(orders)).scalar_one())


def key_rows(engine: Engine) -> int:
    table = schema().processed
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def test_repeat_gets_the_stored_response_and_no_second_effect(engine: Engine) -> None:
    keys = RequestKeys()
    first = place(engine, keys, keyed(), CREATED)
    assert first is CREATED
    again = place(engine, keys, keyed(), StoredResponse(201, (), b"never sent"))
    assert again.status == 201
    assert again.body == b'{"order": 1}'
    assert again.header("location") == "/orders/1"
    assert again.header("content-type") == "application/json"
    assert again.header(REPLAYED_HEADER) == "true"
    assert again.header("set-cookie") is None  # never stored
    assert order_count(engine) == 1
    # The stored row: the fingerprint and the response, no cookie.
    with engine.connect() as connection:
        stored = connection.execute(select(schema().processed.c.result)).scalar_one()
    assert stored["status"] == 201 and "secret" not in json.dumps(stored)


def test_other_payload_is_422_and_other_caller_is_another_key(engine: Engine) -> None:
    keys = RequestKeys()
    place(engine, keys, keyed(), CREATED)
    mismatch = place(engine, keys, keyed(body=b'{"amount": 6}'), CREATED)
    assert mismatch.status == 422
    assert mismatch.header("content-type") == "application/problem+json"
    assert json.loads(mismatch.body)["status"] == 422
    # The same key of another caller is a key of its own.
    assert place(engine, keys, keyed(caller="bob"), CREATED) is CREATED
    assert order_count(engine) == 2


def test_failing_endpoint_leaves_nothing_and_the_key_free(engine: Engine) -> None:
    keys = RequestKeys()
    with pytest.raises(RuntimeError):
        place(engine, keys, keyed(), CREATED, fail=True)
    server_error = StoredResponse(503, (), b"try later")
    assert place(engine, keys, keyed(), server_error) is server_error  # 5xx: not stored
    assert order_count(engine) == 0
    assert key_rows(engine) == 0
    assert place(engine, keys, keyed(), CREATED) is CREATED  # the retry runs
    assert order_count(engine) == 1


def test_binary_body_round_trips(engine: Engine) -> None:
    keys = RequestKeys(stored_headers=("content-type", "x-request-cost"))
    body = bytes(range(256))
    response = StoredResponse(
        200, (("content-type", "application/octet-stream"), ("X-Request-Cost", "3")), body
    )
    place(engine, keys, keyed(), response)
    again = place(engine, keys, keyed(), CREATED)
    assert again.body == body
    assert again.header("x-request-cost") == "3"


def test_committed_claim_without_a_response_is_409(engine: Engine) -> None:
    """A row of the scope written by something else (no stored response): never replayed."""
    keys = RequestKeys()
    with Session(engine) as session, session.begin():
        assert keys.claim(session, keyed()).state is KeyState.NEW
    answer = place(engine, keys, keyed(), CREATED)
    assert answer.status == 409
    assert answer.header("retry-after") == "1"


def test_purge_frees_old_keys(engine: Engine) -> None:
    keys = RequestKeys()
    place(engine, keys, keyed(), CREATED)
    assert DedupStore().purge(engine, timedelta(0), consumer=caller_scope("alice")) == 1
    assert place(engine, keys, keyed(), CREATED) is CREATED
    assert order_count(engine) == 2


@pytest.mark.parametrize(
    ("value", "required", "expected"),
    [
        ("abc-123", True, "abc-123"),
        ('  "8e03978e-40d5"  ', True, "8e03978e-40d5"),
        (None, False, None),
    ],
)
def test_read_key_accepts(value: str | None, required: bool, expected: str | None) -> None:
    assert read_key(value, required=required) == expected


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        (None, "requires an Idempotency-Key header"),
        ("", "is empty"),
        ('""', "is empty"),
        ("x" * 256, "longer than 255"),
        ("clé", "printable ASCII"),
        ("a\x00b", "printable ASCII"),
    ],
)
def test_read_key_refuses_with_400(value: str | None, detail: str) -> None:
    with pytest.raises(IdempotencyKeyError, match=detail) as refused:
        read_key(value, required=True)
    assert refused.value.answer.status == 400
    assert detail in json.loads(refused.value.answer.body)["detail"]


def test_scopes_and_fingerprints() -> None:
    assert caller_scope("alice") == "http:id:alice"
    long_scope = caller_scope("x" * 400)
    assert long_scope.startswith("http:sha256:") and len(long_scope) <= 255
    base = request_fingerprint("POST", "/orders", b"{}")
    assert base == request_fingerprint("post", "/orders", b"{}")
    assert base != request_fingerprint("PUT", "/orders", b"{}")
    assert base != request_fingerprint("POST", "/orders/", b"{}")
    assert base != request_fingerprint("POST", "/orders", b"{}", query="dry=1")
    assert base != request_fingerprint("POST", "/orders", b"{ }")


def test_scopes_never_collide() -> None:
    long_id = "x" * 400
    hashed = caller_scope(long_id)
    assert hashed == "http:sha256:" + hashlib.sha256(long_id.encode()).hexdigest()
    literal = hashed.removeprefix("http:")
    assert caller_scope(literal) != hashed  # a literal id cannot name a hashed scope
    assert caller_scope(SHARED_SCOPE) == "http:shared"
    assert caller_scope("shared") != caller_scope(SHARED_SCOPE)
    for unknown in (None, ""):
        with pytest.raises(CallerUnknownError) as refused:
            caller_scope(unknown)
        assert refused.value.answer.status == 403


@pytest.mark.parametrize("value", ["a,b", "a, b", '"a", "b"', '"a",b', '"a" b', '"open'])
def test_key_lists_and_malformed_strings_are_400(value: str) -> None:
    with pytest.raises(IdempotencyKeyError) as refused:
        read_key(value, required=True)
    assert refused.value.answer.status == 400
    assert read_key('"a,b"', required=True) == "a,b"  # a comma inside the quotes is the key's
    with pytest.raises(IdempotencyKeyError, match="2 Idempotency-Key headers"):
        read_key_headers(["a", "b"], required=True)


def test_never_stored_headers_are_refused_and_bodies_round_trip_exactly(engine: Engine) -> None:
    for header in ("Set-Cookie", "Authorization", "WWW-Authenticate", "Date", "Upgrade"):
        with pytest.raises(ConfigurationError, match=header.lower()):
            RequestKeys(stored_headers=("content-type", header))
    keys = RequestKeys()
    for n, body in enumerate((b"ok\x00", b"\xff\x00", "é".encode(), b"")):
        request = keyed(key=f"bytes-{n}")
        place(engine, keys, request, StoredResponse(200, (), body))
        assert place(engine, keys, request, CREATED).body == body
    with pytest.raises(TypeError, match="bytes, bytearray or memoryview"):
        place(engine, keys, keyed(key="text"), StoredResponse(200, (), "text"))  # type: ignore[arg-type]


def test_an_expired_key_is_claimed_again(engine: Engine) -> None:
    keys = RequestKeys(ttl=timedelta(hours=24))
    place(engine, keys, keyed(), CREATED)
    assert place(engine, keys, keyed(), CREATED).header(REPLAYED_HEADER) == "true"
    table = schema().processed
    with engine.begin() as connection:
        connection.execute(update(table).values(processed_at=utcnow() - timedelta(hours=25)))
    fresh = StoredResponse(201, (), b'{"order": 2}')
    assert place(engine, keys, keyed(body=b"another request"), fresh) is fresh
    assert place(engine, keys, keyed(body=b"another request"), CREATED).body == b'{"order": 2}'
    assert order_count(engine) == 2 and key_rows(engine) == 1
    with pytest.raises(ConfigurationError, match="ttl"):
        RequestKeys(ttl=timedelta(0))


def test_fingerprints_are_unambiguous_and_modes_normalise() -> None:
    # Length prefixes: bytes cannot move from one field to the next.
    assert request_fingerprint("POST", "/p/a\x00b", b"") != request_fingerprint(
        "POST", "/p/a", b"\x00", query="b"
    )
    json_type = "application/json"
    assert request_fingerprint("POST", "/o", b"{}", content_type=json_type) != (
        request_fingerprint("POST", "/o", b"{}", content_type="text/plain")
    )
    one, two = b'{"a": 1, "b": [1, 2]}', b'{"b":[1,2],"a":1}'
    assert request_fingerprint("POST", "/o", one, content_type=json_type) != request_fingerprint(
        "POST", "/o", two, content_type=json_type
    )
    assert request_fingerprint(
        "POST", "/o", one, content_type=json_type, mode="json"
    ) == request_fingerprint("POST", "/o", two, content_type=json_type, mode="json")
    assert request_fingerprint(
        "POST", "/o", one, content_type=json_type, mode="json"
    ) != request_fingerprint(
        "POST", "/o", b'{"a": 2, "b": [1, 2]}', content_type=json_type, mode="json"
    )


def form(boundary: str, content: bytes) -> tuple[bytes, str]:
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="note"\r\n\r\nhi\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="f"; filename="a.txt"\r\n'
            "Content-Type: text/plain\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


def test_multipart_fingerprint_ignores_the_boundary_not_the_parts() -> None:
    def fingerprint(boundary: str, content: bytes) -> str:
        body, content_type = form(boundary, content)
        return request_fingerprint("POST", "/u", body, content_type=content_type)

    first = fingerprint("b-1", b"file\r\n--b-")
    assert first == fingerprint("other-2", b"file\r\n--b-")
    assert first != fingerprint("b-1", b"file 2")
    body, content_type = form("b-1", b"file")
    parts = parse_form(body, "b-1")
    assert parts is not None
    assert [(p.name, p.filename) for p in parts] == [("note", None), ("f", "a.txt")]
    assert parse_form(body[:-8], "b-1") is None  # no close delimiter: counted as bytes
    # Parts handed over separately (Django's POST and FILES) count the same.
    assert form_fingerprint("POST", "/u", reversed(parts), "", content_type) == (
        request_fingerprint("POST", "/u", body, "", content_type)
    )
