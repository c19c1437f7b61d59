"""FastAPI ``Idempotency-Key`` endpoints served by uvicorn, on PostgreSQL and MariaDB.

One uvicorn process per database (``keys_app.py``); every endpoint writes one row of
``<prefix>effects`` per run, so each test counts effects in the database. One test per
finding of issue 29 (scoped keys, nothing sensitive stored, every request can succeed,
clear answers, a sound fingerprint, expiry), and 200 concurrent requests with one key.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import MetaData, func, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker

from mqdedup.db.schema import schema
from mqdedup.dedup.request_keys import KEY_REUSED, SHARED_SCOPE, caller_scope
from mqdedup.errors import ConfigurationError
from mqdedup.fastapi import Idempotency
from tests.integration.http.keys_app import effects_table
from tests.integration.http.servers import BODIES, Server, form_body, free_port, serving
from tests.services import REPO, TestDatabase, prefixed_database

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class App:
    """uvicorn serving ``keys_app`` on one database."""

    server: Server
    db: TestDatabase

    def effects(self, kind: str | None = None) -> list[tuple[str, str]]:
        table = effects_table(self.db.prefix)
        statement = select(table.c.caller, table.c.detail)
        if kind is not None:
            statement = statement.where(table.c.kind == kind)
        with self.db.engine.connect() as connection:
            return [(row.caller, row.detail) for row in connection.execute(statement)]

    def keys(self, key: str) -> int:
        table = schema(self.db.prefix).processed
        with self.db.engine.connect() as connection:
            statement = select(func.count()).where(table.c.message_id == key)
            return int(connection.execute(statement.select_from(table)).scalar_one())


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    if request.param == "postgresql":
        url, service = request.getfixturevalue("pg_url"), "PostgreSQL"
    else:
        url, service = request.getfixturevalue("mariadb_url"), "MariaDB"
    business = MetaData()
    prefix = f"t_{uuid.uuid4().hex[:8]}_"
    effects_table(prefix, business)
    with prefixed_database(url, service, business, prefix=prefix) as db:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "KEYS_DATABASE_URL": db.url,
            "KEYS_PREFIX": prefix,
        }
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "tests.integration.http.keys_app:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--backlog",
            "1024",
            "--timeout-keep-alive",
            "300",
        ]
        log = tmp_path_factory.mktemp("uvicorn") / f"{request.param}.log"
        with serving(command, env, log, "/ready", port) as server:
            yield App(server, db)


def client(app: App) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
    return httpx.AsyncClient(base_url=app.server.url, timeout=60, limits=limits)


def order(
    http: httpx.AsyncClient, key: str | None, item: str, user: str | None = "alice", amount: int = 1
) -> asyncio.Future[httpx.Response]:
    headers = {} if key is None else {"Idempotency-Key": key}
    if user is not None:
        headers["X-User"] = user
    return asyncio.ensure_future(
        http.post("/orders", json={"item": item, "amount": amount}, headers=headers)
    )


def new_key() -> str:
    return uuid.uuid4().hex


def test_two_hundred_concurrent_requests_with_one_key(app: App) -> None:
    """One effect; the other 199 get 409 while it is in flight, then the replay."""
    key, tag = new_key(), new_key()[:8]
    item = f"hold-{tag}"

    async def scenario() -> None:
        async with client(app) as http:
            requests = [order(http, key, item) for _ in range(200)]
            answered: list[httpx.Response] = []
            pending = set(requests)
            while len(answered) < 199:
                done, pending = await asyncio.wait(
                    pending, timeout=60, return_when="FIRST_COMPLETED"
                )
                assert done, f"only {len(answered)} answered while the first was in flight"
                answered += [task.result() for task in done]
            assert len(answered) == 199 and len(pending) == 1
            assert Counter(a.status_code for a in answered) == {409: 199}
            assert all(a.headers["retry-after"] == "1" for a in answered)
            assert item not in [detail for _, detail in app.effects("order")]  # uncommitted
            (await http.post(f"/release/{tag}")).raise_for_status()
            (held,) = pending
            first = await asyncio.wait_for(held, timeout=60)
            assert first.status_code == 201, first.text
            assert "idempotent-replayed" not in first.headers
            repeats = await asyncio.gather(*(order(http, key, item) for _ in range(199)))
            for repeat in repeats:
                assert repeat.status_code == 201
                assert repeat.content == first.content
                assert repeat.headers["idempotent-replayed"] == "true"
                assert "set-cookie" not in repeat.headers

    asyncio.run(scenario())
    assert [detail for _, detail in app.effects("order")].count(item) == 1
    assert app.keys(key) == 1


def test_cross_caller_attack_on_every_documented_configuration(app: App) -> None:
    """Another client never gets alice's stored response, nor learns that her key exists
    (the configuration without a caller is refused: test_construction_refusals)."""
    long_alice = "alice@" + "x" * 300  # longer than a scope: hashed
    key = new_key()

    async def scenario() -> None:
        async with client(app) as http:
            for n, victim in enumerate(("alice", long_alice)):
                placed = await order(http, key, "card", user=victim)
                assert placed.status_code == 201
                token = placed.json()["card_token"]
                again = await order(http, key, "card", user=victim)
                assert again.json()["card_token"] == token  # her own replay works
                hashed = "sha256:" + hashlib.sha256(victim.encode()).hexdigest()
                for attacker in (f"mallory{n}", hashed, "http:" + victim, "id:" + victim):
                    stolen = await order(http, key, "card", user=attacker)
                    assert stolen.status_code == 201, (attacker, stolen.text)
                    assert "idempotent-replayed" not in stolen.headers
                    assert stolen.json()["card_token"] != token
                    probe = await order(http, key, "other", user=attacker + "-2")
                    assert probe.status_code == 201  # not 422: the key's existence is not told
            # Without a caller identity: refused, not served from a shared key space.
            for _ in range(2):
                anonymous = await order(http, new_key(), "card", user=None)
                assert anonymous.status_code == 403
                assert anonymous.headers["content-type"] == "application/problem+json"
                assert "SHARED_SCOPE" in anonymous.json()["detail"]

    asyncio.run(scenario())
    # The explicit shared scope is a scope no caller id can name either.
    assert caller_scope(SHARED_SCOPE) not in {caller_scope("shared"), caller_scope("http:shared")}


def test_construction_refusals() -> None:
    """No caller (the old default: one key space for everybody), or a sensitive header."""
    with pytest.raises(ConfigurationError, match=r"caller=.*SHARED_SCOPE"):
        Idempotency(async_sessionmaker())
    for header in (
        "Set-Cookie",
        "authorization",
        "Proxy-Authenticate",
        "WWW-Authenticate",
        "date",
        "Connection",
        "Transfer-Encoding",
    ):
        with pytest.raises(ConfigurationError, match=header.lower()):
            Idempotency(
                async_sessionmaker(),
                caller=SHARED_SCOPE,
                stored_headers=("content-type", header),
            )


def test_any_body_bytes_are_stored_exactly(app: App) -> None:
    async def scenario() -> None:
        async with client(app) as http:
            for kind, body in BODIES.items():
                key = new_key()
                first = await http.post(
                    f"/binary/{kind}", headers={"Idempotency-Key": key, "X-User": "a"}
                )
                assert first.status_code == 200, first.text
                assert first.content == body
                again = await http.post(
                    f"/binary/{kind}", headers={"Idempotency-Key": key, "X-User": "a"}
                )
                assert again.headers["idempotent-replayed"] == "true"
                assert again.content == body
            view = [
                await http.post("/view", headers={"Idempotency-Key": "mv", "X-User": "a"})
                for _ in range(2)
            ]
            assert [v.status_code for v in view] == [200, 200]
            assert view[1].content == b"a memoryview body"
            assert view[1].headers["idempotent-replayed"] == "true"

    asyncio.run(scenario())
    assert sorted(detail for _, detail in app.effects("binary")) == sorted(BODIES)
    assert len(app.effects("view")) == 1


def test_an_endpoint_that_commits_itself_commits_nothing(app: App) -> None:
    key = new_key()

    async def scenario() -> list[httpx.Response]:
        answers = []
        for _ in range(2):  # a connection each: a server error may close the connection
            async with client(app) as http:
                headers = {"Idempotency-Key": key, "X-User": "a"}
                answers.append(await http.post("/commits", headers=headers))
        return answers

    answers = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [500, 500]  # never 409: no orphan key
    assert app.effects("commits") == []
    assert app.keys(key) == 0
    assert "must not commit, roll back" in app.server.log_text()


def test_two_keys_or_a_list_is_400(app: App) -> None:
    async def scenario() -> list[httpx.Response]:
        async with client(app) as http:
            body = {"item": "two-keys", "amount": 1}
            twice = [("Idempotency-Key", "k-a"), ("Idempotency-Key", "k-b"), ("X-User", "a")]
            answers = [await http.post("/orders", json=body, headers=twice)]
            for value in ("k-a, k-b", '"k-a", "k-b"'):
                answers.append(
                    await http.post(
                        "/orders", json=body, headers={"Idempotency-Key": value, "X-User": "a"}
                    )
                )
            return answers

    for answer in asyncio.run(scenario()):
        assert answer.status_code == 400, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
    assert [d for _, d in app.effects("order") if d == "two-keys"] == []


def test_key_reuse_is_a_422_of_its_own_type(app: App) -> None:
    key = new_key()

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with client(app) as http:
            assert (await order(http, key, "pen")).status_code == 201
            reused = await order(http, key, "pen", amount=2)
            invalid = await http.post(
                "/orders",
                json={"item": "pen", "amount": "many"},
                headers={"Idempotency-Key": new_key(), "X-User": "alice"},
            )
            return reused, invalid

    reused, invalid = asyncio.run(scenario())
    assert reused.status_code == invalid.status_code == 422
    assert reused.headers["content-type"] == "application/problem+json"
    assert reused.json()["type"] == KEY_REUSED
    assert "type" not in invalid.json()  # FastAPI's own validation error


def test_fingerprint_fields_cannot_run_into_each_other(app: App) -> None:
    key = new_key()

    async def scenario() -> list[httpx.Response]:
        async with client(app) as http:
            headers = {"Idempotency-Key": key, "X-User": "a", "Content-Type": "text/plain"}
            first = await http.post("/p/a%00b", content=b"", headers=headers)
            other = await http.post("/p/a?b", content=b"\x00", headers=headers)
            typed = await http.post(
                "/p/a%00b", content=b"", headers={**headers, "Content-Type": "application/json"}
            )
            return [first, other, typed]

    first, other, typed = asyncio.run(scenario())
    assert first.status_code == 200
    assert other.status_code == 422  # another request, not first's response
    assert typed.status_code == 422  # Content-Type is part of the request


def test_json_fingerprint_and_multipart_boundaries(app: App) -> None:
    async def scenario() -> None:
        async with client(app) as http:
            key = new_key()
            headers = {"Idempotency-Key": key, "X-User": "a", "Content-Type": "application/json"}
            first = await http.post("/json", content=b'{"a": 1, "b": [1, 2]}', headers=headers)
            again = await http.post("/json", content=b'{"b":[1,2],\n "a":1}', headers=headers)
            assert again.status_code == 200 and again.content == first.content
            assert again.headers["idempotent-replayed"] == "true"
            other = await http.post("/json", content=b'{"a": 2, "b": [1, 2]}', headers=headers)
            assert other.status_code == 422

            key = new_key()
            answers = []
            for boundary in ("first-boundary-1", "another-boundary-2"):
                body = form_body(boundary, b"\x00" * 1000 + b"file bytes")
                answers.append(
                    await http.post(
                        "/raw",
                        content=body,
                        headers={
                            "Idempotency-Key": key,
                            "X-User": "a",
                            "Content-Type": f"multipart/form-data; boundary={boundary}",
                        },
                    )
                )
            assert [a.status_code for a in answers] == [200, 200]
            assert answers[1].content == answers[0].content
            changed = form_body("third-boundary-3", b"other file bytes")
            reused = await http.post(
                "/raw",
                content=changed,
                headers={
                    "Idempotency-Key": key,
                    "X-User": "a",
                    "Content-Type": "multipart/form-data; boundary=third-boundary-3",
                },
            )
            assert reused.status_code == 422

    asyncio.run(scenario())
    assert len(app.effects("json")) == 1 and len(app.effects("raw")) == 1


def test_an_expired_key_is_claimed_again_once(app: App) -> None:
    """Past its ttl (24 h) a key is new again: two concurrent reuses give one effect."""
    key, tag = new_key(), new_key()[:8]
    item = f"hold-{tag}"
    table = schema(app.db.prefix).processed

    async def scenario() -> None:
        async with client(app) as http:
            (await http.post(f"/release/{tag}-old")).raise_for_status()
            old = await order(http, key, f"hold-{tag}-old")
            assert old.status_code == 201
            with app.db.engine.begin() as connection:
                stamp = select(table.c.processed_at).where(table.c.message_id == key)
                claimed = connection.execute(stamp).scalar_one()
                connection.execute(
                    update(table)
                    .where(table.c.message_id == key)
                    .values(processed_at=claimed - timedelta(hours=25))
                )
            first, second = order(http, key, item), order(http, key, item)
            done, pending = await asyncio.wait(
                {first, second}, timeout=60, return_when="FIRST_COMPLETED"
            )
            (busy,) = [task.result() for task in done]
            assert busy.status_code == 409, busy.text
            (await http.post(f"/release/{tag}")).raise_for_status()
            (held,) = pending
            placed = await asyncio.wait_for(held, timeout=60)
            assert placed.status_code == 201
            assert placed.json()["card_token"] != old.json()["card_token"]
            replay = await order(http, key, item)
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.content == placed.content

    asyncio.run(scenario())
    details = [detail for _, detail in app.effects("order")]
    assert details.count(item) == 1  # the two concurrent reuses: one effect
    assert app.keys(key) == 1
