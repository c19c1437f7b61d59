"""The console's pages over SQLite tables, without a socket: the overview's per-minute
counts from the claims, the claim lookup and forget (claim, steps and attempts go, as with
``mqdedup dedup forget``), and duplicates per minute from the workers' ``/metrics``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select

from mqdedup.console import ConsoleApp, ConsoleSettings
from mqdedup.console.data import processed_per_minute
from mqdedup.console.web import Request, Response
from mqdedup.db.engine import create_engine, init_schema
from mqdedup.db.schema import schema

PREFIX = "mqdedup_"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    bound = create_engine(f"sqlite:///{tmp_path / 'console.db'}")
    init_schema(bound, PREFIX)
    yield bound
    bound.dispose()


def _get(app: ConsoleApp, target: str, cookie: str = "") -> Response:
    headers = {"host": "127.0.0.1:8470", "cookie": cookie}
    return app.handle(Request.parse("GET", target, headers, b"", "127.0.0.1"))


def _claims(engine: Engine, moments: list[datetime]) -> None:
    table = schema(PREFIX).processed
    with engine.begin() as connection:
        connection.execute(
            insert(table),
            [
                {"consumer_name": "orders", "message_id": f"m-{n}", "processed_at": at}
                for n, at in enumerate(moments)
            ],
        )


def test_processed_per_minute_counts_the_claims_of_each_minute(engine: Engine) -> None:
    now = datetime.now(UTC).replace(second=30, microsecond=0)
    _claims(engine, [now, now, now - timedelta(minutes=2), now - timedelta(hours=5)])
    counts = processed_per_minute(engine, PREFIX, now - timedelta(hours=1))
    minute = now.replace(second=0)
    assert counts == {"orders": {minute: 2, minute - timedelta(minutes=2): 1}}
    page = _get(ConsoleApp(ConsoleSettings(engine=engine, prefix=PREFIX)), "/").body.decode()
    assert "orders: 3 processed" in page and "<polyline" in page


def test_a_forgotten_claim_loses_its_steps_and_attempts_too(engine: Engine) -> None:
    now = datetime.now(UTC)
    _claims(engine, [now])
    tables = schema(PREFIX)
    with engine.begin() as connection:
        connection.execute(insert(tables.steps).values(
            consumer_name="orders", message_id="m-0", name="charge", state="done",
            attempts=1, result={"ok": True}, started_at=now, completed_at=now,
        ))  # fmt: skip
    app = ConsoleApp(ConsoleSettings(engine=engine, prefix=PREFIX))
    found = _get(app, "/claims?consumer=orders&id=m-0")
    assert "charge" in found.body.decode() and "Forget this claim" in found.body.decode()
    cookie = found.headers["Set-Cookie"].split(";", 1)[0]
    confirm = _get(app, "/claims/forget?consumer=orders&id=m-0", cookie).body.decode()
    csrf = re.search(r'name="csrf" value="([^"]+)"', confirm)
    assert csrf is not None
    done = app.handle(Request.parse(
        "POST", "/claims/forget", {"host": "127.0.0.1:8470", "cookie": cookie},
        f"csrf={csrf.group(1)}&consumer=orders&id=m-0".encode(), "127.0.0.1",
    ))  # fmt: skip
    assert "forgot 1 claim(s)" in done.body.decode()
    with engine.connect() as connection:
        for table in (tables.processed, tables.steps, tables.attempts):
            assert connection.execute(select(func.count()).select_from(table)).scalar_one() == 0
        audit = connection.execute(select(tables.audit.c.action, tables.audit.c.messages)).one()
    assert tuple(audit) == ("forget-claim", 1)


def test_duplicates_per_minute_come_from_the_workers_metrics(engine: Engine) -> None:
    from mqdedup.cli.health import render_snapshots
    from mqdedup.console.metrics import MetricsSampler, totals

    def exposition(first: int, second: int) -> str:  # two worker processes of "orders"
        return render_snapshots(
            {("orders", "0"): {"duplicates": first}, ("orders", "1"): {"duplicates": second}}
        )

    assert totals(exposition(5, 2)) == {"orders": 7.0}
    pages = iter([exposition(5, 2), exposition(8, 2), exposition(1, 2)])  # then a restart
    sampler = MetricsSampler(["http://worker:9400/metrics"], fetch=lambda _url: next(pages))
    start = datetime.now(UTC).replace(second=0, microsecond=0)
    for minute in range(3):
        sampler.sample(start + timedelta(minutes=minute))
    assert sampler.per_minute() == {
        "orders": {start + timedelta(minutes=1): 3, start + timedelta(minutes=2): 1}
    }
    app = ConsoleApp(ConsoleSettings(engine=engine, prefix=PREFIX, metrics=sampler))
    page = _get(app, "/").body.decode()
    assert "orders: 0 processed, 4 duplicates (since the console started)" in page


def test_an_unreadable_metrics_url_is_named_masked(engine: Engine) -> None:
    from mqdedup.console.metrics import MetricsSampler

    def refuse(_url: str) -> str:
        raise ConnectionRefusedError("refused")

    sampler = MetricsSampler(["http://ops:pw1234@worker:9400/metrics"], fetch=refuse)
    sampler.sample()
    page = _get(ConsoleApp(ConsoleSettings(engine=engine, prefix=PREFIX, metrics=sampler)), "/")
    text = page.body.decode()
    assert "metrics unreadable: http://ops:***@worker:9400/metrics: ConnectionRefusedError" in text
    assert "pw1234" not in text
