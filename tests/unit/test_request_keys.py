"""HTTP idempotency keys on SQLite: the answers, stored responses, failures, purge."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.request_keys import (
    REPLAYED_HEADER,
    IdempotencyKeyError,
    KeyedRequest,
    KeyState,
    RequestKeys,
    StoredResponse,
    caller_scope,
    read_key,
    request_fingerprint,
)
from mqdedup.dedup.store import DedupStore
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
