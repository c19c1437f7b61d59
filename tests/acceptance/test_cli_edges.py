"""The CLI's rough edges (issue #12): the real ``mqdedup`` command as a subprocess.

Each bad input ends with one line on stderr, its documented exit code and no traceback.
None of these tests needs a running broker (unreachable ones are closed local ports);
the database is a SQLite file per test.
"""

from __future__ import annotations

import io
import json
import os
import pty
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select

from mqdedup import __version__
from mqdedup.cli import exitcodes
from mqdedup.cli.demo import demo_orders, run_demo
from mqdedup.cli.replay import format_replay_report
from mqdedup.consumers.replay import ReplayReport
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.store import utcnow
from mqdedup.outbox.writer import OutboxWriter
from tests.services import REPO, KafkaHelper, Outgoing, free_port
from tests.support import orders_table

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
EDGES = "tests.acceptance.edge_consumers"


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    stdin: Any = subprocess.DEVNULL,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MQDEDUP_") or key == "MQDEDUP_TEST_DATABASE_URL"
    }
    environment["PYTHONPATH"] = str(REPO)
    environment.update(env or {})
    return subprocess.run(
        [MQDEDUP, *args],
        env=environment,
        cwd=REPO,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    """The documented exit code, one line on stderr containing ``text``, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1, result.stderr
    assert text in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.fixture
def database(tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    url = f"sqlite:///{tmp_path / 'edges.db'}"
    engine = create_engine(url)
    init_schema(engine)
    yield url, engine
    engine.dispose()


def _claims(engine: Engine, *ages: timedelta) -> None:
    table = schema().processed
    now = utcnow()
    with engine.begin() as connection:
        connection.execute(
            insert(table),
            [
                {"consumer_name": "edge", "message_id": f"m-{n}", "processed_at": now - age}
                for n, age in enumerate(ages)
            ],
        )


def _claim_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(
            connection.execute(select(func.count()).select_from(schema().processed)).scalar_one()
        )


# -- flags -------------------------------------------------------------------------------


def test_version() -> None:
    result = cli("--version")
    assert result.returncode == exitcodes.OK
    assert result.stdout.strip() == f"mqdedup {__version__}"


@pytest.mark.parametrize("where", ["before", "after"])
def test_common_flags_work_before_and_after_the_command(
    where: str, database: tuple[str, Engine], tmp_path: Path
) -> None:
    url, _ = database
    config = tmp_path / "edges.toml"
    config.write_text(f'[mqdedup]\ndatabase_url = "{url}"\ntable_prefix = "edgy_"\n')
    flags = ["--log-level", "info", "--config", str(config)]
    args = [*flags, "db", "init"] if where == "before" else ["db", "init", *flags]
    result = cli(*args)
    assert result.returncode == exitcodes.OK, result.stderr
    assert "created: edgy_processed_messages" in result.stdout  # --config was read
    assert "INFO mqdedup" in result.stderr  # --log-level was applied

    debug = ["--debug", "db", "check"] if where == "before" else ["db", "check", "--debug"]
    failed = cli(*debug, "--database", "nonsense")
    assert failed.returncode == exitcodes.CONFIGURATION
    assert "Traceback" in failed.stderr  # --debug was applied


def test_a_flag_given_before_the_command_is_not_reset_by_its_absence_after() -> None:
    result = cli("--debug", "--log-level", "ERROR", "db", "check", "--database", "nonsense")
    assert result.returncode == exitcodes.CONFIGURATION
    assert "Traceback" in result.stderr


# -- one line, documented exit code ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--log-level", "BOGUS", "db", "check"], exitcodes.USAGE, "unknown log level 'BOGUS'"),
        (["db", "check", "--log-level", "BOGUS"], exitcodes.USAGE, "unknown log level 'BOGUS'"),
        (["dedup", "purge", "--older-than", "soon"], exitcodes.USAGE, "invalid duration 'soon'"),
        (
            ["worker", f"{EDGES}:Plain", "--health-port", "99999"],
            exitcodes.CONFIGURATION,
            "--health-port: 99999 is out of range for health_port (0-65535)",
        ),
        (
            ["worker", f"{EDGES}:NeedsArguments"],
            exitcodes.CONSUMER_IMPORT,
            f"{EDGES}:NeedsArguments cannot be created without arguments: "
            "missing a required argument: 'tenant'",
        ),
        (
            ["status", f"{EDGES}:NeedsArguments"],
            exitcodes.CONSUMER_IMPORT,
            "cannot be created without arguments",
        ),
        (
            ["replay", f"{EDGES}:KafkaNeedsArguments"],
            exitcodes.CONSUMER_IMPORT,
            "cannot be created without arguments",
        ),
        (
            ["db", "check", "--database", "nonsense"],
            exitcodes.CONFIGURATION,
            "malformed database URL 'nonsense': expected e.g. postgresql://user@host:5432/dbname",
        ),
    ],
)
def test_bad_input_is_one_line_with_its_exit_code(
    args: list[str], code: int, text: str, database: tuple[str, Engine]
) -> None:
    result = cli(*args, env={"MQDEDUP_DATABASE_URL": database[0]})
    assert_one_line(result, code, text)


def test_a_malformed_database_url_shows_its_parts_but_not_the_password() -> None:
    result = cli("db", "check", "--database", "postgresql://app:s3cret@db:5432:x/app")
    assert_one_line(result, exitcodes.CONFIGURATION, "expected e.g.")
    assert "s3cret" not in result.stderr
    assert "db:5432:x/app" in result.stderr


def test_a_health_port_in_use_is_one_line(database: tuple[str, Engine]) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # the health endpoint binds all interfaces
        taken.listen()
        port = taken.getsockname()[1]
        result = cli(
            "worker", f"{EDGES}:Plain", "--health-port", str(port),
            env={"MQDEDUP_DATABASE_URL": database[0]},
        )  # fmt: skip
    assert_one_line(
        result, exitcodes.CONFIGURATION, f"cannot serve /healthz and /metrics on port {port}"
    )


@pytest.mark.parametrize(
    ("content", "text"),
    [
        (
            '[mqdedup]\ndatabse_url = "sqlite:///elsewhere.db"\n',
            "unknown setting 'databse_url' in [mqdedup] of {path} (did you mean 'database_url'?)",
        ),
        (
            "[wroker]\nprocesses = 2\n",
            "unknown section [wroker] in {path} (did you mean [worker]?)",
        ),
        ("[relay]\nbatch = 10\n", "unknown setting 'batch' in [relay] of {path}"),
        (
            'database_url = "sqlite:///x.db"\n',
            "outside a section in {path} (put it under [mqdedup])",
        ),
    ],
)
def test_config_typos_are_refused_with_the_nearest_name(
    tmp_path: Path, content: str, text: str
) -> None:
    config = tmp_path / "mqdedup.toml"
    config.write_text(content)
    result = cli("db", "check", "--config", str(config))
    assert_one_line(result, exitcodes.CONFIGURATION, text.format(path=config))
    assert not (REPO / "mqdedup.db").exists() or "elsewhere" not in content


# -- dedup purge -------------------------------------------------------------------------


def test_purge_dry_run_counts_and_deletes_nothing(database: tuple[str, Engine]) -> None:
    url, engine = database
    _claims(engine, timedelta(hours=2), timedelta(days=10), timedelta(days=20))
    result = cli("dedup", "purge", "--older-than", "7d", "--dry-run", "--database", url)
    assert result.returncode == exitcodes.OK, result.stderr
    assert result.stdout.strip() == "would delete 2 dedup records older than 7d (dry run)"
    assert _claim_count(engine) == 3


def test_purge_below_a_day_is_refused_without_yes(database: tuple[str, Engine]) -> None:
    url, engine = database
    _claims(engine, timedelta(hours=2), timedelta(days=10))
    refused = cli("dedup", "purge", "--older-than", "0s", "--database", url)
    assert_one_line(refused, exitcodes.CHECK_FAILED, "pass --yes to confirm")
    assert "--older-than 0s is below 1d" in refused.stderr
    assert _claim_count(engine) == 2  # nothing deleted

    week = cli("dedup", "purge", "--older-than", "7d", "--database", url)
    assert week.returncode == exitcodes.OK, week.stderr
    assert week.stdout.strip() == "deleted 1 dedup records older than 7d"

    confirmed = cli("dedup", "purge", "--older-than", "1h", "--yes", "--database", url)
    assert confirmed.returncode == exitcodes.OK, confirmed.stderr
    assert confirmed.stdout.strip() == "deleted 1 dedup records older than 1h"
    assert _claim_count(engine) == 0


@pytest.mark.parametrize(("answer", "left"), [("n", 2), ("y", 0)])
def test_purge_below_a_day_asks_on_a_terminal(
    database: tuple[str, Engine], answer: str, left: int
) -> None:
    url, engine = database
    _claims(engine, timedelta(hours=2), timedelta(days=10))
    controller, terminal = pty.openpty()
    try:
        os.write(controller, f"{answer}\n".encode())
        result = cli("dedup", "purge", "--older-than", "30m", "--database", url, stdin=terminal)
    finally:
        os.close(terminal)
        os.close(controller)
    assert "Delete them? [y/N]" in result.stdout
    assert "Traceback" not in result.stderr
    assert result.returncode == (exitcodes.OK if answer == "y" else exitcodes.CHECK_FAILED)
    assert _claim_count(engine) == left


def test_outbox_purge_dry_run_prints_the_duration_as_given(database: tuple[str, Engine]) -> None:
    url, _ = database
    result = cli("outbox", "purge", "--older-than", "2w", "--dry-run", "--database", url)
    assert result.returncode == exitcodes.OK, result.stderr
    assert result.stdout.strip() == "would delete 0 published outbox row(s) older than 2w (dry run)"
    real = cli("outbox", "purge", "--older-than", "36h", "--database", url)
    assert real.stdout.strip() == "deleted 0 published outbox row(s) older than 36h"


# -- JSON output and the default exchange ------------------------------------------------


def _outbox_rows(engine: Engine) -> None:
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        writer = OutboxWriter(session)
        writer.publish({"n": 1}, exchange="", routing_key="jobs", broker="rabbitmq")
        writer.publish({"n": 2}, exchange="", routing_key="jobs", broker="rabbitmq")
        writer.publish({"n": 3}, topic="events", broker="kafka")


def test_json_output_has_stable_keys(database: tuple[str, Engine]) -> None:
    url, engine = database
    _claims(engine, timedelta(hours=1), timedelta(days=2))
    _outbox_rows(engine)

    stats = json.loads(cli("dedup", "stats", "--json", "--database", url).stdout)
    assert set(stats) == {"consumers", "records", "size_bytes"}
    assert stats["records"] == 2
    (edge,) = stats["consumers"]
    assert set(edge) == {
        "consumer", "records", "oldest", "newest", "oldest_age_seconds", "newest_age_seconds"
    }  # fmt: skip
    assert edge["consumer"] == "edge" and edge["records"] == 2
    assert 2 * 86400 - 60 < edge["oldest_age_seconds"] < 2 * 86400 + 60

    outbox = json.loads(cli("outbox", "status", "--json", "--database", url).stdout)
    assert set(outbox) == {
        "pending", "failed", "published", "oldest_pending_age_seconds", "destinations"
    }  # fmt: skip
    assert outbox["pending"] == 3
    by_broker = {d["broker"]: d for d in outbox["destinations"]}
    assert by_broker["rabbitmq"]["destination"] == "" and by_broker["rabbitmq"]["pending"] == 2
    assert by_broker["kafka"]["destination"] == "events"

    status = cli("status", "--json", "--database", url)
    assert status.returncode == exitcodes.OK, status.stderr
    data = json.loads(status.stdout)
    assert set(data) == {"consumers", "dedup", "outbox", "dead_letters", "dead_letter_depths"}
    assert data["dedup"] == {**stats, "consumers": data["dedup"]["consumers"]}
    assert data["outbox"]["pending"] == 3 and data["dead_letters"] == {}


def test_outbox_status_names_the_default_exchange(database: tuple[str, Engine]) -> None:
    url, engine = database
    _outbox_rows(engine)
    result = cli("outbox", "status", "--database", url)
    assert result.returncode == exitcodes.OK, result.stderr
    rabbit = next(line for line in result.stdout.splitlines() if line.startswith("rabbitmq"))
    assert rabbit.split()[1:3] == ["(default", "exchange)"]


# -- brokers that cannot be reached ------------------------------------------------------


def test_status_prints_what_it_can_when_rabbitmq_is_unreachable(
    database: tuple[str, Engine],
) -> None:
    url, engine = database
    _claims(engine, timedelta(hours=1))
    port = free_port()
    env = {"EDGE_RABBITMQ_URL": f"amqp://g:pw@127.0.0.1:{port}/%2F"}
    result = cli("status", f"{EDGES}:Rabbit", "--database", url, env=env)
    assert_one_line(
        result, exitcodes.BROKER_UNAVAILABLE, f"cannot reach RabbitMQ at 127.0.0.1:{port}"
    )
    consumer_line = next(line for line in result.stdout.splitlines() if "edge-queue" in line)
    assert f"cannot reach RabbitMQ at 127.0.0.1:{port}" in consumer_line  # in the lag column
    assert "Dedup table" in result.stdout and "1 records" in result.stdout
    assert "Outbox" in result.stdout and "pw@" not in result.stdout + result.stderr

    as_json = cli("status", f"{EDGES}:Rabbit", "--json", "--database", url, env=env)
    assert as_json.returncode == exitcodes.BROKER_UNAVAILABLE
    (entry,) = json.loads(as_json.stdout)["consumers"]
    assert entry["lag"] is None and entry["unreachable"] is True
    assert f"127.0.0.1:{port}" in entry["error"]


@pytest.mark.parametrize(("consumer", "broker"), [("Rabbit", "RabbitMQ"), ("Kafka", "Kafka")])
def test_workers_wait_for_an_unreachable_broker_the_same_way(
    database: tuple[str, Engine], consumer: str, broker: str
) -> None:
    port = free_port()
    env = {
        "MQDEDUP_DATABASE_URL": database[0],
        "EDGE_RABBITMQ_URL": f"amqp://g:pw@127.0.0.1:{port}/%2F",
        "EDGE_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
        "EDGE_TIMEOUT": "2",
    }
    started = time.monotonic()
    result = cli("worker", f"{EDGES}:{consumer}", env=env)
    elapsed = time.monotonic() - started
    lines = result.stderr.strip().splitlines()
    assert result.returncode == exitcodes.BROKER_UNAVAILABLE, result.stderr
    assert lines[0].startswith(f"mqdedup: waiting up to 2s for {broker}: cannot reach {broker}")
    assert lines[-1].startswith("mqdedup: error: cannot reach") and "(waited 2s)" in lines[-1]
    assert len(lines) == 2 and "Traceback" not in result.stderr
    assert 2.0 <= elapsed < 20


# -- the demo ----------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_demo_progress_bar_moves_per_batch_without_crashes() -> None:
    terminal = _Terminal()
    result = run_demo(messages=1000, crash_rate=0.0, progress=terminal)
    assert result.exactly_once and result.nothing_lost
    frames = [frame for frame in terminal.getvalue().split("\r") if "%" in frame]
    percents = [int(frame.split("]")[1].split("%")[0]) for frame in frames]
    assert len(percents) >= 10  # one frame per batch of 50, not one jump at the end
    assert percents == sorted(percents) and percents[0] < 50


def test_demo_prints_plain_progress_lines_without_a_terminal(tmp_path: Path) -> None:
    result = cli("demo", "--messages", "600", "--database", f"sqlite:///{tmp_path / 'd.db'}")
    assert result.returncode == exitcodes.OK, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("demo: ")]
    assert len(lines) >= 3 and lines[-1].endswith("(100%)")
    assert "\r" not in result.stderr


def test_demo_refuses_a_database_whose_demo_orders_holds_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mine.db'}"
    engine = create_engine(url)
    demo_orders.create(engine)
    with engine.begin() as connection:
        connection.execute(insert(demo_orders).values(order_id="1", message_id="m", amount=5))
    refused = cli("demo", "--messages", "50", "--database", url)
    assert_one_line(refused, exitcodes.CHECK_FAILED, "holds 1 row(s)")
    assert "--force" in refused.stderr
    with engine.connect() as connection:
        assert connection.execute(select(demo_orders.c.order_id)).scalars().all() == ["1"]
    forced = cli("demo", "--messages", "50", "--database", url, "--force")
    assert forced.returncode == exitcodes.OK, forced.stderr
    engine.dispose()


def test_demo_help_says_what_it_does_to_the_database() -> None:
    result = cli("demo", "--help")
    assert "DROPS" in result.stdout and "demo_orders" in result.stdout
    assert "--force" in result.stdout


# -- replay report -----------------------------------------------------------------------


def _report_count(output: str, label: str) -> int:
    line = next(line for line in output.splitlines() if line.strip().startswith(label))
    return int(line.split()[-1].replace(",", ""))


@pytest.mark.integration
def test_a_kafka_replay_counts_id_less_messages_as_dead_lettered_on_every_run(
    tmp_path: Path, kafka: KafkaHelper
) -> None:
    """Real Kafka: two id-less messages among three good ones, replayed twice."""
    bootstrap = kafka.bootstrap
    prefix = "edge_replay_"
    url = f"sqlite:///{tmp_path / 'replay.db'}"
    engine = create_engine(url)
    try:
        init_schema(engine, prefix)
        orders_table(prefix).create(engine)
        topic = kafka.create_topic(partitions=1, kind="edge-replay")
        kafka.produce(
            topic,
            [Outgoing(f"m-{n}", b'{"n": 1}') for n in range(3)]
            + [Outgoing(None, b'{"n": 2}'), Outgoing(None, b'{"n": 3}')],
        )
        env = {
            "ACCEPT_PREFIX": prefix,
            "ACCEPT_TOPIC": topic,
            "ACCEPT_GROUP": f"group-{topic}",
            "MQDEDUP_DATABASE_URL": url,
            "MQDEDUP_KAFKA_BOOTSTRAP": bootstrap,
        }
        replay = ["replay", "tests.acceptance.cli_consumers:Orders", "--from", "beginning"]
        for run, new in ((1, 3), (2, 0)):
            result = cli(*replay, env=env, timeout=120)
            # Dead letters: the documented non-zero code, after the whole summary.
            assert result.returncode == exitcodes.DEAD_LETTERED, result.stderr
            assert "2 of 5 message(s) dead-lettered" in result.stderr
            assert _report_count(result.stdout, "new (processed now)") == new
            assert _report_count(result.stdout, "dead-lettered: without a message id") == 2
            assert _report_count(result.stdout, "dead-lettered in total") == 2
            assert "dead-lettered them again" in result.stdout
            # What the report says happened: two more copies on the dead-letter topic.
            assert len(kafka.read_all(f"{topic}.DLT", expected=2 * run)) == 2 * run
        with engine.connect() as connection:
            rows = connection.execute(select(func.count()).select_from(orders_table(prefix)))
            assert rows.scalar_one() == 3
    finally:
        engine.dispose()


def test_replay_report_counts_id_less_messages_as_dead_lettered() -> None:
    report = ReplayReport(
        new=3, duplicates=5, without_id=2, dead_lettered=1, ranges={"t/0": (0, 11)}
    )
    text = format_replay_report(report)
    rows = {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in text.splitlines()[2:9]}
    assert rows["dead-lettered: without a message id"] == "2"
    assert rows["dead-lettered: handler kept failing"] == "1"
    assert rows["dead-lettered in total"] == "3"
    assert "dead-lettered them again (every replay over this range does)" in text
