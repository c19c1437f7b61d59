"""``mqdedup console`` in a real browser: Debian's Chromium, headless, driven by Playwright,
against consoles on the shared PostgreSQL, Kafka and RabbitMQ with real dead letters
(consumers whose handler raised ``MessageError``).

One console with a token and one ``--read-only`` console serve the whole module. The
tests run in file order: the page checks first, then the refused requests (nothing
changes), then the replay of the 500-message group (twice: effects once), then the
claims and outbox actions. Screenshots of each page go to ``docs/images/console/``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select

from mqdedup.db.schema import schema
from mqdedup.dedup.dead_letters import DeadLetterCause, DeadLetterTable
from mqdedup.message import Message
from mqdedup.stopping import StopToken
from tests.services import (
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    free_port,
    prefixed_database,
    require_module,
    require_service,
    table_prefix,
    unique_name,
    wait_for,
)
from tests.support import orders_table

sync_api = require_module("playwright.sync_api")

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "images" / "console"
CHROMIUM = os.environ.get("MQDEDUP_CHROMIUM", "/usr/bin/chromium")
TOKEN = "browser-test-token-7f3a"
GROUP_SIZE = 500
MARKUP = b"<script>alert('owned')</script> note"
#: Where the replay figure is written (docs/console.md quotes it).
FIGURES = Path(os.environ.get("MQDEDUP_CONSOLE_FIGURES", "/tmp/mqdedup-console-figures.json"))


@dataclass
class Stack:
    """The module's services, consoles and browser."""

    engine: Engine
    prefix: str
    topic: str
    queue: str
    url: str
    read_only_url: str
    browser: Any
    kafka: KafkaHelper
    rabbit: RabbitAdmin


def _start_console(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "mqdedup.cli.main", "console",
        "tests.acceptance.console_consumers:KafkaOrders",
        "tests.acceptance.console_consumers:RabbitOrders",
        "--port", str(port), *args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError(
                f"the console exited: {process.stderr.read() if process.stderr else ''}"
            )
        try:
            urllib.request.urlopen(f"{url}/static/console.css", timeout=2).close()
            return True
        except (urllib.error.URLError, ConnectionError):
            return False

    wait_for(answers, 60, "the console to answer", interval=0.2)
    return process, url


def _run_until(consumer: Any, engine: Engine, done: Any, what: str) -> None:
    """Run ``consumer`` on a thread until ``done()``; stop it."""
    stop = StopToken()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            consumer.run(engine, stop=stop)
        except BaseException as error:  # reported below
            failure.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        wait_for(lambda: bool(failure) or done(), 120, what, interval=0.2)
    finally:
        stop.request()
        thread.join(60)
    if failure:
        raise failure[0]


@pytest.fixture(scope="module")
def stack(pg_url: str, kafka_bootstrap: str, rabbitmq_url: str) -> Iterator[Stack]:
    if not Path(CHROMIUM).is_file():  # skipped locally, a failure in CI
        require_service("Chromium", f"{CHROMIUM} is missing: bash scripts/services.sh browser")
    prefix = table_prefix()
    topic, group, queue = (
        unique_name("console"),
        unique_name("console-group"),
        unique_name("console"),
    )
    variables = {
        "CONSOLE_PREFIX": prefix,
        "CONSOLE_TOPIC": topic,
        "CONSOLE_GROUP": group,
        "CONSOLE_QUEUE": queue,
        "MQDEDUP_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
    }
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    sys.modules.pop("tests.acceptance.console_consumers", None)  # read the variables
    from tests.acceptance import console_consumers

    kafka = KafkaHelper(kafka_bootstrap)
    rabbit = RabbitAdmin(rabbitmq_url)
    processes: list[subprocess.Popen[str]] = []
    with prefixed_database(
        pg_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix
    ) as db:
        try:
            _make_dead_letters(db.engine, prefix, kafka, rabbit, topic, queue, console_consumers)
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "MQDEDUP_DATABASE_URL": pg_url,
                "MQDEDUP_CONSOLE_TOKEN": TOKEN,
            }
            env.pop(console_consumers.BROKEN_ENV, None)
            console, url = _start_console(env)
            processes.append(console)
            read_only_env = {k: v for k, v in env.items() if k != "MQDEDUP_CONSOLE_TOKEN"}
            read_only, read_only_url = _start_console(read_only_env, "--read-only")
            processes.append(read_only)
            with sync_api.sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
                try:
                    yield Stack(db.engine, prefix, topic, queue, url, read_only_url, browser,
                                kafka, rabbit)  # fmt: skip
                finally:
                    browser.close()
        finally:
            for process in processes:
                process.terminate()
                process.wait(30)
            kafka.close()
            rabbit.close()
            for name, value in saved.items():  # as they were: the run's broker URLs stay set
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _make_dead_letters(
    engine: Engine, prefix: str, kafka: KafkaHelper, rabbit: RabbitAdmin, topic: str,
    queue: str, consumers: Any,
) -> None:  # fmt: skip
    """Real dead letters: the consumers run while their handler raises MessageError."""
    os.environ[consumers.BROKEN_ENV] = "1"
    try:
        kafka.create_topic(partitions=1, name=topic)
        kafka.create_topic(partitions=1, name=f"{topic}.DLT")
        outgoing = [
            Outgoing(f"order-{n:03d}", json.dumps({"n": n}).encode()) for n in range(GROUP_SIZE)
        ]
        outgoing.append(Outgoing("order-markup", MARKUP))
        kafka.produce(topic, outgoing)
        _run_until(
            consumers.KafkaOrders(), engine,
            lambda: sum(kafka.end_offsets(f"{topic}.DLT").values()) >= GROUP_SIZE + 1,
            "the Kafka dead letters",
        )  # fmt: skip
        rabbit_consumer = consumers.RabbitOrders()
        rabbit.declare(rabbit_consumer)
        rabbit.created.extend([queue, f"{queue}.dlq"])
        rabbit.publish(queue, [f"rabbit-{n}" for n in range(3)])
        _run_until(rabbit_consumer, engine, lambda: rabbit.depth(f"{queue}.dlq") == 3,
                   "the RabbitMQ dead letters")  # fmt: skip
    finally:
        os.environ.pop(consumers.BROKEN_ENV, None)
    # A dead letter the broker refused, kept in the database (as the processor keeps it).
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        DeadLetterTable(prefix).park(
            session, consumers.KafkaOrders().consumer_name,
            Message(body=b'{"n": "huge"}', id="order-huge", source=topic, partition=0, offset=9,
                    headers={"message-id": b"order-huge",
                             "x-callback": b"https://shop:hunter22@hooks.example/cb"}),
            DeadLetterCause("downstream rejected the order", 1, "MessageSizeTooLargeError",
                            "mqdedup.errors.MessageError", "downstream rejected the order"),
        )  # fmt: skip


def _page(stack: Stack, *, read_only: bool = False) -> Any:
    """A signed-in page (the token entered on the sign-in form)."""
    page = stack.browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.dialogs = dialogs
    if read_only:
        page.goto(stack.read_only_url + "/")
        return page
    page.goto(stack.url + "/")
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(stack.url + "/")
    return page


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _orders(stack: Stack) -> dict[str, int]:
    table = orders_table(stack.prefix)
    with stack.engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        )
        return {row[0]: row[1] for row in rows}


def _audit(stack: Stack) -> list[Any]:
    table = schema(stack.prefix).audit
    with stack.engine.connect() as connection:
        return list(connection.execute(select(table).order_by(table.c.id)).all())


def _dlt_count(stack: Stack) -> int:
    """Kafka dead letters the console still lists (handled ones are marked, not removed)."""
    from mqdedup.kafka.dead_letter_topic import KafkaDeadLetterTopics

    place = KafkaDeadLetterTopics(
        stack.kafka.bootstrap, stack.engine, topics=[f"{stack.topic}.DLT"], prefix=stack.prefix
    )
    return place.depth()


# -- the pages -------------------------------------------------------------------------------


def test_the_overview_shows_throughput_dead_letters_lag_and_the_outbox(stack: Stack) -> None:
    page = _page(stack)
    text = page.inner_text("main")
    assert "Processed per minute" in text and page.locator("svg polyline").count() >= 1
    assert re.search(r"kafka\s+501", text), text
    assert re.search(r"rabbitmq\s+3", text) and re.search(r"database\s+1", text)
    assert stack.topic in text  # the Kafka lag per partition
    assert "Relay leases" in text and "oldest unpublished" in text


def test_dead_letters_from_all_three_places_grouped_by_consumer_and_error(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters")
    text = page.inner_text("main")
    assert "kafka: 501 dead letter(s)" in text and "rabbitmq: 3 dead letter(s)" in text
    assert "database: 1 dead letter(s)" in text
    assert re.search(rf"downstream rejected the order\s+{GROUP_SIZE}\b", text), text
    assert "the order's note holds markup" in text
    _shot(page, "dead-letters")


def test_a_body_with_a_script_shows_as_text_and_runs_nothing(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters")
    row = page.locator("tr", has_text="the order's note holds markup")
    row.get_by_role("link", name="open").click()
    page.get_by_role("link", name=re.compile(r"\.DLT:0:")).first.click()
    body = page.locator("pre.body").last
    assert body.inner_text().startswith("<script>alert('owned')</script> note")
    assert page.locator("main script").count() == 0
    assert page.dialogs == []  # no alert fired
    _shot(page, "dead-letter")


def test_a_kept_dead_letters_secret_header_is_masked(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters/message?place=database&key=" + _database_key(stack))
    text = page.inner_text("main")
    assert "https://shop:***@hooks.example/cb" in text and "hunter22" not in text


def _database_key(stack: Stack) -> str:
    table = schema(stack.prefix).dead_letters
    with stack.engine.connect() as connection:
        return str(connection.execute(select(table.c.id)).scalar_one())


def test_read_only_shows_no_action(stack: Stack) -> None:
    page = _page(stack, read_only=True)
    for path in ("/", "/dead-letters", "/outbox", "/claims"):
        page.goto(stack.read_only_url + path)
        assert page.locator("form[method=post]").count() == 0, path
        assert (
            page.get_by_role("link", name=re.compile("replay|requeue|delete|Retry|Forget")).count()
            == 0
        )
    assert "read-only" in page.inner_text("body")
    page.goto(stack.read_only_url + "/dead-letters")
    _shot(page, "read-only")


def test_requests_without_the_token_or_the_csrf_token_change_nothing(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters/confirm?" + _group_query("downstream rejected the order"))
    form = page.locator("form[method=post]")
    keys = form.locator("input[name=key]").evaluate_all("(nodes) => nodes.map(n => n.value)")
    assert len(keys) == GROUP_SIZE
    fields = [("action", "replay"), ("place", "kafka"), ("consumer", _group_name(stack))]
    fields += [("key", key) for key in keys]
    before = (_orders(stack), len(_audit(stack)), _dlt_count(stack))
    # no token at all (a fresh client); the token but no CSRF token; a wrong CSRF token
    for headers, extra in (
        ({}, []),
        ({"Authorization": f"Bearer {TOKEN}"}, []),
        ({"Authorization": f"Bearer {TOKEN}"}, [("csrf", "forged")]),
    ):
        status = _post(stack.url + "/dead-letters/act", fields + extra, headers)
        assert status == 403
    # the browser's own session, from another site's page
    response = page.request.post(
        stack.url + "/dead-letters/act", form=dict(fields[:3]),
        headers={"Origin": "http://evil.example"},
    )  # fmt: skip
    assert response.status == 403
    assert (_orders(stack), len(_audit(stack)), _dlt_count(stack)) == before


def _post(url: str, fields: list[tuple[str, str]], headers: dict[str, str]) -> int:
    from urllib.parse import urlencode

    request = urllib.request.Request(
        url, data=urlencode(fields).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _group_name(stack: Stack) -> str:
    return os.environ["CONSOLE_GROUP"]


def _group_query(error_part: str) -> str:
    from urllib.parse import urlencode

    group = os.environ["CONSOLE_GROUP"]
    return urlencode({"action": "replay", "place": "kafka", "consumer": group,
                      "error": f"mqdedup.errors.MessageError: {error_part}"})  # fmt: skip


# -- the replay ------------------------------------------------------------------------------


def test_a_group_replayed_from_the_page_twice_runs_each_message_once(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters")
    row = page.locator("tr", has_text="downstream rejected the order").filter(
        has_text=str(GROUP_SIZE)
    )
    row.get_by_role("link", name="replay…").click()
    assert f"Run {GROUP_SIZE} dead letter(s) of kafka" in page.inner_text("main")
    _shot(page, "confirm-replay")
    # The same confirmation open in a second tab: its button is clicked after the first.
    other = page.context.new_page()
    other.goto(page.url)
    page.set_default_timeout(180_000)
    other.set_default_timeout(180_000)
    started = time.monotonic()
    page.get_by_role("button", name=f"Replay {GROUP_SIZE}").click()
    page.wait_for_selector("p.result")
    seconds = time.monotonic() - started
    first = page.inner_text("p.result")
    assert f"replayed {GROUP_SIZE} dead letter(s): {GROUP_SIZE} processed" in first, first
    _shot(page, "replayed")
    other.get_by_role("button", name=f"Replay {GROUP_SIZE}").click()
    other.wait_for_selector("p.result")
    second = other.inner_text("p.result")
    orders = _orders(stack)
    ids = {f"order-{n:03d}" for n in range(GROUP_SIZE)}
    assert {k: v for k, v in orders.items() if k in ids} == dict.fromkeys(ids, 1)
    audit = [row for row in _audit(stack) if row.action == "replay-dead-letters"]
    assert [row.messages for row in audit] == [GROUP_SIZE, 0], second
    assert all(row.actor.startswith("token@") for row in audit)
    assert _dlt_count(stack) == 1  # only the markup letter is left
    FIGURES.write_text(json.dumps({
        "messages": GROUP_SIZE, "seconds": round(seconds, 2), "rows": len(ids),
        "max_rows_per_id": max(orders[i] for i in ids), "audit": [r.messages for r in audit],
        "second_click": second,
    }))  # fmt: skip
    print(f"\nconsole replay of {GROUP_SIZE}: {seconds:.2f} s; second click: {second}")


# -- claims, outbox, audit -------------------------------------------------------------------


def test_a_claim_is_looked_up_and_forgotten_after_confirmation(stack: Stack) -> None:
    page = _page(stack)
    group = _group_name(stack)
    page.goto(stack.url + "/claims")
    page.fill("input[name=consumer]", group)
    page.fill("input[name=id]", "order-007")
    page.get_by_role("button", name="Look up").click()
    assert "processed at" in page.inner_text("main")
    _shot(page, "claims")
    page.get_by_role("link", name="Forget this claim…").click()
    assert "runs its handler again" in page.inner_text("main")
    page.get_by_role("button", name="Forget the claim").click()
    assert "forgot 1 claim(s)" in page.inner_text("p.result")
    processed = schema(stack.prefix).processed
    with stack.engine.connect() as connection:
        left = connection.execute(
            select(func.count()).select_from(processed).where(processed.c.message_id == "order-007")
        ).scalar_one()
    assert left == 0
    assert _audit(stack)[-1].action == "forget-claim"


def test_failed_outbox_rows_are_shown_and_retried(stack: Stack) -> None:
    table = schema(stack.prefix).outbox
    now = datetime.now(UTC)
    with stack.engine.begin() as connection:
        connection.execute(insert(table).values(
            message_id="out-1", broker="kafka", destination="invoices", shard_hash=0, headers=[],
            payload=b"{}", state="failed", attempts=8, created_at=now, available_at=now,
            last_error="KafkaTimeoutError: no broker answered for invoices within 30 s",
        ))  # fmt: skip
    page = _page(stack)
    page.goto(stack.url + "/outbox")
    assert "KafkaTimeoutError" in page.inner_text("main")
    _shot(page, "outbox")
    page.get_by_role("link", name="Retry…").first.click()
    page.get_by_role("button", name="Retry").click()
    assert "put 1 failed outbox row(s) back to pending" in page.inner_text("p.result")
    with stack.engine.connect() as connection:
        assert connection.execute(select(table.c.state)).scalar_one() == "pending"
    page.goto(stack.url + "/audit")
    assert page.locator("tbody tr").count() == len(_audit(stack))
    _shot(page, "audit")


def test_a_rabbitmq_group_is_requeued_to_its_queue(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters")
    row = page.locator("tr", has_text=_group_name_rabbit(stack)).filter(has_text="rejected")
    row.get_by_role("link", name="requeue…").click()
    assert "Send 3 dead letter(s) back to their source" in page.inner_text("main")
    page.get_by_role("button", name="Requeue 3").click()
    assert "requeued 3 dead letter(s) from rabbitmq" in page.inner_text("p.result")
    assert stack.rabbit.depth(f"{stack.queue}.dlq") == 0
    assert stack.rabbit.depth(stack.queue) == 3  # back in the source queue, same ids
    assert _audit(stack)[-1].action == "requeue-dead-letters"
    assert _audit(stack)[-1].messages == 3


def _group_name_rabbit(stack: Stack) -> str:
    return stack.queue  # a RabbitMQ consumer's name is its queue


def test_a_kept_dead_letter_is_replayed_from_its_page(stack: Stack) -> None:
    page = _page(stack)
    page.goto(stack.url + "/dead-letters/message?place=database&key=" + _database_key(stack))
    page.get_by_role("link", name="replay…").click()
    page.get_by_role("button", name="Replay 1").click()
    assert "1 processed" in page.inner_text("p.result")
    assert _orders(stack)["order-huge"] == 1
    table = schema(stack.prefix).dead_letters
    with stack.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(table)).scalar_one() == 0


def test_the_overview_counts_the_replayed_messages(stack: Stack) -> None:
    page = _page(stack)
    text = page.inner_text("main")
    group = _group_name(stack)
    # 500 replayed, one claim forgotten since, the kept dead letter replayed
    assert re.search(rf"{group}: {GROUP_SIZE} processed", text), text
    assert re.search(r"kafka\s+1\b", text), text
    _shot(page, "overview")
