"""Django ``@idempotent`` views served by ``manage.py runserver``, on PostgreSQL and MariaDB.

The project is ``keys_project`` (Django is set up in the server process only); every view
writes one ``<prefix>effects`` row per run, so each test counts effects in the database.
One test per finding of issue 29 for Django: scoped keys (anonymous requests refused,
users isolated), form posts with CSRF and large uploads, 413 beyond Django's limits,
template responses, exact bodies, a view that ends the transaction, key lists, 422's
own type, and an expired key claimed again once.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import MetaData, func, select, update

from mqdedup.db.schema import schema
from mqdedup.dedup.request_keys import CALLER_UNKNOWN, KEY_REUSED, REQUEST_TOO_LARGE
from tests.integration.http.keys_app import effects_table
from tests.integration.http.servers import BODIES, Server, form_body, free_port, serving
from tests.services import REPO, TestDatabase, prefixed_database

pytestmark = pytest.mark.integration
CSRF = "c" * 32  # a CSRF secret: the cookie and the form field carry the same one


@dataclass(frozen=True)
class Site:
    """runserver serving ``keys_project`` on one database."""

    server: Server
    db: TestDatabase

    def effects(self, kind: str) -> list[str]:
        table = effects_table(self.db.prefix)
        statement = select(table.c.detail).where(table.c.kind == kind)
        with self.db.engine.connect() as connection:
            return list(connection.execute(statement).scalars())

    def keys(self, key: str) -> int:
        table = schema(self.db.prefix).processed
        statement = select(func.count()).select_from(table).where(table.c.message_id == key)
        with self.db.engine.connect() as connection:
            return int(connection.execute(statement).scalar_one())


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def site(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Site]:
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
            "DJANGO_SETTINGS_MODULE": "tests.integration.django.keys_project.settings",
            "KEYS_DATABASE_URL": db.url,
            "KEYS_PREFIX": prefix,
        }
        command = [
            sys.executable,
            "-m",
            "django",
            "runserver",
            "--noreload",
            "--skip-checks",
            f"127.0.0.1:{port}",
        ]
        log = tmp_path_factory.mktemp("runserver") / f"{request.param}.log"
        with serving(command, env, log, "/ready/", port) as server:
            yield Site(server, db)


def http(site: Site) -> httpx.Client:
    return httpx.Client(base_url=site.server.url, timeout=60)


def new_key() -> str:
    return uuid.uuid4().hex


def order(
    client: httpx.Client, key: str, item: str, user: str | None = "1", path: str = "/orders/"
) -> httpx.Response:
    headers = {"Idempotency-Key": key}
    if user is not None:
        headers["X-User"] = user
    return client.post(path, json={"item": item}, headers=headers)


def test_keys_are_the_users_and_anonymous_requests_are_refused(site: Site) -> None:
    """The documented default (``@idempotent``): another client never gets alice's response."""
    key = new_key()
    with http(site) as client:
        placed = order(client, key, "card", user="1")
        assert placed.status_code == 201
        token = placed.json()["card_token"]
        replay = order(client, key, "card", user="1")
        assert replay.json()["card_token"] == token
        assert "set-cookie" not in replay.headers  # never stored
        for attacker in ("2", "3"):
            stolen = order(client, key, "card", user=attacker)
            assert stolen.status_code == 201 and stolen.json()["card_token"] != token
            assert "idempotent-replayed" not in stolen.headers
        assert order(client, key, "other", user="4").status_code == 201  # no 422 probe
        # Anonymous clients with a key: a clear 403, not one shared key space.
        for _ in range(2):
            anonymous = order(client, key, "card", user=None)
            assert anonymous.status_code == 403
            assert anonymous.json()["type"] == CALLER_UNKNOWN
            assert "SHARED_SCOPE" in anonymous.json()["detail"]
        # A view that opts into the shared space by name serves anonymous clients.
        shared = [client.post("/shared/", headers={"Idempotency-Key": key}) for _ in range(2)]
        assert [s.status_code for s in shared] == [201, 201]
        assert shared[1].headers["idempotent-replayed"] == "true"
    assert site.effects("order").count("card") == 3  # alice's and the two attackers'
    assert len(site.effects("shared")) == 1


def test_form_posts_with_csrf_and_large_uploads(site: Site) -> None:
    big = bytes(range(256)) * (3 * 1024 * 4)  # 3 MiB: beyond DATA_UPLOAD_MAX_MEMORY_SIZE
    with http(site) as client:
        client.cookies.set("csrftoken", CSRF)
        for path, content in (("/form/", b"small \x00 file"), ("/upload/", big)):
            key, answers = new_key(), []
            for boundary in ("boundary-one", "boundary-two"):  # a retry: a new boundary
                body = form_body(boundary, content, csrfmiddlewaretoken=CSRF)
                answers.append(
                    client.post(
                        path,
                        content=body,
                        headers={
                            "Idempotency-Key": key,
                            "X-User": "1",
                            "Content-Type": f"multipart/form-data; boundary={boundary}",
                        },
                    )
                )
            assert [a.status_code for a in answers] == [201, 201], answers[0].text[:500]
            assert answers[1].content == answers[0].content
            assert answers[1].headers["idempotent-replayed"] == "true"
        too_big = client.post(
            "/orders/",
            json={"item": "x" * (3 * 1024 * 1024)},
            headers={"Idempotency-Key": new_key(), "X-User": "1"},
        )
    assert len(site.effects("form")) == 1 and len(site.effects("upload")) == 1
    assert site.effects("upload")[0].startswith(f"hello|{len(big)}|")
    assert too_big.status_code == 413
    assert too_big.headers["content-type"] == "application/problem+json"
    assert too_big.json()["type"] == REQUEST_TOO_LARGE
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in too_big.json()["detail"]


def test_template_responses_and_any_body_bytes(site: Site) -> None:
    with http(site) as client:
        for path in ("/template/", "/simple-template/", *(f"/binary/{k}/" for k in BODIES)):
            key = new_key()
            first, again = (
                client.post(path, headers={"Idempotency-Key": key, "X-User": "1"}) for _ in range(2)
            )
            assert first.status_code == again.status_code == 200, (path, first.text[:300])
            assert again.content == first.content
            assert again.headers["idempotent-replayed"] == "true"
            if path.startswith("/binary/"):
                assert first.content == BODIES[path.split("/")[2]]
            else:
                assert first.content.startswith(b"<p>order ")
    assert len(site.effects("template")) == len(site.effects("simple-template")) == 1
    assert sorted(site.effects("binary")) == sorted(BODIES)


def test_a_view_that_commits_itself_commits_nothing(site: Site) -> None:
    key = new_key()
    with http(site) as client:
        answers = [
            client.post("/commits/", headers={"Idempotency-Key": key, "X-User": "1"})
            for _ in range(2)
        ]
    assert [a.status_code for a in answers] == [500, 500]  # never 409: no orphan key
    assert site.effects("commits") == []
    assert site.keys(key) == 0
    assert "must not end or break the transaction" in site.server.log_text()


def test_key_lists_are_400_and_reuse_is_a_422_of_its_own_type(site: Site) -> None:
    key = new_key()
    with http(site) as client:
        twice = [("Idempotency-Key", "k-a"), ("Idempotency-Key", "k-b"), ("X-User", "1")]
        listed = client.post("/orders/", json={"item": "listed"}, headers=twice)
        assert order(client, key, "pen").status_code == 201
        reused = order(client, key, "pencil")
    assert listed.status_code == 400
    assert listed.headers["content-type"] == "application/problem+json"
    assert site.effects("order").count("listed") == 0
    assert reused.status_code == 422
    assert reused.json()["type"] == KEY_REUSED


def test_an_expired_key_is_claimed_again_once(site: Site) -> None:
    key, tag = new_key(), new_key()[:8]
    table = schema(site.db.prefix).processed
    with http(site) as client:
        assert order(client, key, "old").status_code == 201
        with site.db.engine.begin() as connection:
            claimed = connection.execute(
                select(table.c.processed_at).where(table.c.message_id == key)
            ).scalar_one()
            connection.execute(
                update(table)
                .where(table.c.message_id == key)
                .values(processed_at=claimed - timedelta(hours=25))
            )
        first_answered = threading.Event()
        with ThreadPoolExecutor(2) as pool:

            def reuse() -> httpx.Response:
                with http(site) as own:
                    answer = order(own, key, f"hold-{tag}")
                first_answered.set()
                return answer

            runs = [pool.submit(reuse) for _ in range(2)]
            assert first_answered.wait(60)  # one is answered while the other holds the key
            client.post(f"/release/{tag}/")
            answers = sorted(run.result(timeout=60).status_code for run in runs)
        assert answers == [201, 409]
        replay = order(client, key, f"hold-{tag}")
        assert replay.headers["idempotent-replayed"] == "true"
    assert site.effects("order").count(f"hold-{tag}") == 1  # one effect
    assert site.keys(key) == 1
