"""Faults on real Kafka and PostgreSQL with the offsets in the database (issue 44).

The consumer (``offsets_consumers.OffsetsOrders``) has ``offsets_in_database = True``
and coordinate message ids, so no claim is written: the offset rows, written in the
batch's transaction and fenced against a late writer, are all that keeps a redelivered
record from a second effect. Workers are real processes, killed with SIGKILL, paused
with SIGSTOP / SIGCONT, joined and stopped while the topic grows. Every test ends with
each message's business row exactly once and the offset rows equal to the group's
committed offsets (the admin's ``list_group_offsets``) and to the end of the topic.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, Table, func, inspect, select, update

from tests.integration.kafka.helpers import row_counts
from tests.integration.kafka.offsets_consumers import SPEC_ENV
from tests.services import (
    REPO,
    KafkaHelper,
    Outgoing,
    TestDatabase,
    free_port,
    kill_session_timeout_ms,
    unique_name,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
CONSUMER = "tests.integration.kafka.offsets_consumers:OffsetsOrders"


# -- what the database and the broker say ------------------------------------------------


def offset_rows(engine: Engine, prefix: str, group: str, topic: str) -> dict[int, int]:
    """``partition -> next offset`` stored in ``<prefix>kafka_offsets`` for the group's
    ``topic`` (a row without an offset yet is left out).

    The table is reflected from the database, so the check reads what the feature
    stored, not the framework's idea of it."""
    name = f"{prefix}kafka_offsets"
    if not inspect(engine).has_table(name):
        raise AssertionError(f"no {name} table: offsets_in_database stored nothing")
    table = Table(name, MetaData(), autoload_with=engine)
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.partition, table.c.next_offset).where(
                table.c.group_id == group, table.c.topic == topic
            )
        ).all()
    return {int(row[0]): int(row[1]) for row in rows if row[1] is not None}


def group_offsets(kafka: KafkaHelper, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets on the broker (the admin API lag tools read)."""
    found = kafka.admin.list_group_offsets({group: None}).get(group, {})
    return {
        tp.partition: meta.offset
        for tp, meta in found.items()
        if tp.topic == topic and meta.offset >= 0
    }


def offsets_at_end(db: TestDatabase, kafka: KafkaHelper, group: str, topic: str) -> bool:
    end = {p: o for p, o in kafka.end_offsets(topic).items() if o > 0}
    return (
        offset_rows(db.engine, db.prefix, group, topic) == end
        and group_offsets(kafka, group, topic) == end
    )


def assert_final_state(
    db: TestDatabase, kafka: KafkaHelper, group: str, topic: str, ids: Iterable[str]
) -> None:
    """Every message's effect once; the offset rows == the group's committed == the end."""
    counts = row_counts(db.engine, db.prefix)
    expected = set(ids)
    assert set(counts) == expected, f"missing {sorted(expected - set(counts))[:5]}"
    doubled = {k: v for k, v in counts.items() if v != 1}
    assert not doubled, f"applied more than once: {sorted(doubled.items())[:5]}"
    stored = offset_rows(db.engine, db.prefix, group, topic)
    assert stored == group_offsets(kafka, group, topic)
    assert stored == {p: o for p, o in kafka.end_offsets(topic).items() if o > 0}


def rows_by(engine: Engine, prefix: str, worker: str, ids: Iterable[str]) -> int:
    """Committed business rows written by process ``worker`` for ``ids``."""
    table = orders_table(prefix)
    with engine.connect() as connection:
        return int(
            connection.execute(
                select(func.count()).where(
                    table.c.worker == worker, table.c.message_id.in_(list(ids))
                )
            ).scalar_one()
        )


def messages(tag: str, count: int, partitions: int) -> list[Outgoing]:
    return [
        Outgoing(f"{tag}-{i}", f"body-{tag}-{i}".encode(), partition=i % partitions)
        for i in range(count)
    ]


# -- processes ----------------------------------------------------------------------------


def environment(db: TestDatabase, spec: dict[str, Any]) -> dict[str, str]:
    return {
        **os.environ,
        SPEC_ENV: json.dumps(spec),
        "MQDEDUP_DATABASE_URL": db.url,
        "MQDEDUP_TABLE_PREFIX": db.prefix,
        "MQDEDUP_KAFKA_BOOTSTRAP": spec["bootstrap"],
        "PYTHONPATH": str(REPO),
    }


class Process:
    """A worker process (its output in ``<workdir>/<label>.log``)."""

    def __init__(self, command: list[str], env: dict[str, str], workdir: Path, label: str) -> None:
        self.label = label
        self.log_path = workdir / f"{label}.log"
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, like a crash."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful stop) and its exit code (SIGKILL after ``timeout``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused process cannot stop
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)
            self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def ensure_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"{self.label} exited:\n{self.log_tail()}")


def bare_worker(db: TestDatabase, spec: dict[str, Any], workdir: Path, label: str) -> Process:
    """``python -m tests.integration.kafka.offsets_consumers``: one consumer process."""
    command = [sys.executable, "-m", "tests.integration.kafka.offsets_consumers"]
    return Process(command, environment(db, spec), workdir, label)


def healthz(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return dict(json.load(reply))
    except OSError:
        return {}


def held_pid(control: Path) -> int | None:
    """The pid of the process holding at an armed point (``held-<pid>``), if any."""
    for path in control.glob("held-*"):
        return int(path.name.removeprefix("held-"))
    return None


def wait_held(control: Path, watched: Process, what: str) -> int:
    wait_for(lambda: held_pid(control) is not None or watched.process.poll() is not None, 60, what)
    watched.ensure_alive()
    pid = held_pid(control)
    assert pid is not None
    (control / f"held-{pid}").unlink()
    return pid


@pytest.fixture
def base(kafka_helper: KafkaHelper, tmp_path: Path) -> dict[str, Any]:
    control = tmp_path / "control"
    control.mkdir()
    session = kill_session_timeout_ms(kafka_helper.bootstrap)
    return {
        "bootstrap": kafka_helper.bootstrap,
        "group": unique_name("group"),
        "control": str(control),
        "batch_size": 20,
        "session_timeout_ms": session,
        "heartbeat_interval_ms": max(session // 3, 300),
    }


# -- the tests ----------------------------------------------------------------------------


def test_kill_9_of_worker_children_three_times_mid_batch(
    kafka_helper: KafkaHelper, db: TestDatabase, base: dict[str, Any], tmp_path: Path
) -> None:
    """``mqdedup worker --processes 2``; a child is killed with SIGKILL three times: at a
    random moment, inside a handler (transaction open), and after the batch's database
    commit before its broker commit. The supervisor restarts each; the restarted child
    seeks to the database's offsets, so nothing is lost and nothing applied twice."""
    topic = kafka_helper.create_topic(partitions=4)
    group = base["group"]
    control = Path(base["control"])
    spec = {**base, "topic": topic, "prefix": db.prefix, "delay": 0.02}
    port = free_port()
    command = [MQDEDUP, "worker", CONSUMER, "--processes", "2", "--health-port", str(port)]
    supervisor = Process(
        [*command, "--shutdown-timeout", "20"], environment(db, spec), tmp_path, "supervisor"
    )
    ids: list[str] = []

    def produce(tag: str, count: int) -> None:
        batch = messages(tag, count, 4)
        kafka_helper.produce(topic, batch)
        ids.extend(m.message_id or "" for m in batch)

    try:
        # 1. a random moment: a child killed while the first messages flow
        produce("a", 160)
        wait_for(
            lambda: (
                len(healthz(port).get("pids", [])) == 2 or supervisor.process.poll() is not None
            ),
            60,
            "two worker children",
        )
        wait_for(lambda: sum(row_counts(db.engine, db.prefix).values()) >= 40, 60, "40 rows")
        supervisor.ensure_alive()
        os.kill(healthz(port)["pids"][0], signal.SIGKILL)

        # 2. inside a handler: its row inserted, its transaction open
        (control / "arm-handler").touch()
        produce("b", 80)
        victim = wait_held(control, supervisor, "a child to hold inside a handler")
        os.kill(victim, signal.SIGKILL)

        # 3. the batch committed in the database, its offsets not yet on the broker
        (control / "arm-after_commit").touch()
        produce("c", 80)
        victim = wait_held(control, supervisor, "a child to hold after its commit")
        stored = offset_rows(db.engine, db.prefix, group, topic)
        committed = group_offsets(kafka_helper, group, topic)
        os.kill(victim, signal.SIGKILL)
        ahead = {p: o for p, o in stored.items() if o > (committed.get(p) or 0)}
        assert ahead, f"the kill missed the window: stored {stored}, committed {committed}"

        produce("d", 80)
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 90, "offsets at the end")
        assert healthz(port).get("restarts", 0) >= 3, healthz(port)
    finally:
        (control / "go").touch()  # a held child stops at once
        code = supervisor.terminate()
    assert code == 0, supervisor.log_tail()
    assert_final_state(db, kafka_helper, group, topic, ids)


def test_rebalance_storm_while_the_topic_grows(
    kafka_helper: KafkaHelper, db: TestDatabase, base: dict[str, Any], tmp_path: Path
) -> None:
    """Workers join, leave (SIGTERM) and die (SIGKILL, right after a batch's database
    commit, before its broker commit) while messages flow, and the topic grows from 3 to
    6 partitions mid-run: every partition, old or new, ends with its offset row at its
    end and each message applied once."""
    from kafka.admin import NewPartitions

    topic = kafka_helper.create_topic(partitions=3)
    group = base["group"]
    control = Path(base["control"])
    spec = {**base, "topic": topic, "prefix": db.prefix, "delay": 0.05}
    ids: list[str] = []
    grown = KafkaHelper(kafka_helper.bootstrap)  # a producer that knows the new partitions

    def produce(helper: KafkaHelper, tag: str, count: int, partitions: int) -> None:
        batch = messages(tag, count, partitions)
        helper.produce(topic, batch)
        ids.extend(m.message_id or "" for m in batch)

    workers: dict[str, Process] = {}
    try:
        produce(kafka_helper, "a", 150, 3)
        for name in ("w1", "w2"):
            workers[name] = bare_worker(db, spec, tmp_path, name)
        wait_for(lambda: sum(row_counts(db.engine, db.prefix).values()) >= 20, 60, "20 rows")
        workers["w3"] = bare_worker(db, spec, tmp_path, "w3")
        produce(kafka_helper, "b", 90, 3)
        kafka_helper.admin.create_partitions({topic: NewPartitions(total_count=6)})
        wait_for(lambda: len(kafka_helper.end_offsets(topic)) == 6, 30, "six partitions")
        produce(grown, "c", 180, 6)
        wait_for(
            lambda: any(p >= 3 for p in offset_rows(db.engine, db.prefix, group, topic)),
            60,
            "a new partition consumed",
        )
        # One dies right after a batch's database commit, before its broker commit ...
        (control / "arm-after_commit").touch()
        produce(grown, "d", 120, 6)
        wait_for(lambda: held_pid(control) is not None, 60, "a worker to hold after a commit")
        victim = next(n for n, w in workers.items() if w.pid == held_pid(control))
        stored = offset_rows(db.engine, db.prefix, group, topic)
        committed = group_offsets(kafka_helper, group, topic)
        workers.pop(victim).kill()
        assert any(o > (committed.get(p) or 0) for p, o in stored.items()), (stored, committed)
        # ... another leaves the group, a fourth joins.
        leaving = next(iter(workers))
        assert workers.pop(leaving).terminate() == 0
        workers["w4"] = bare_worker(db, spec, tmp_path, "w4")
        produce(grown, "e", 60, 6)
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 90, "offsets at the end")
    finally:
        (control / "go").touch()  # a held worker stops at once
        codes = {name: worker.terminate() for name, worker in workers.items()}
        grown.close(delete_topics=False)
    assert set(codes.values()) == {0}, {n: workers[n].log_tail() for n in codes}
    assert_final_state(db, kafka_helper, group, topic, ids)


def test_a_zombie_paused_past_its_session_is_fenced_and_rolls_back(
    kafka_helper: KafkaHelper, db: TestDatabase, base: dict[str, Any], tmp_path: Path
) -> None:
    """The zombie is paused (SIGSTOP) inside a handler, its batch's rows written in an
    open transaction, until the group drops it and a new worker processes the same
    records. Let go (SIGCONT), it commits late: the conditional write of the offset row
    fails, so its transaction rolls back and its rows never land."""
    topic = kafka_helper.create_topic(partitions=1)
    group = base["group"]
    control = Path(base["control"])
    spec = {**base, "topic": topic, "prefix": db.prefix, "max_poll_interval_ms": 10000}
    ids: list[str] = []

    def produce(tag: str, count: int) -> list[str]:
        batch = messages(tag, count, 1)
        kafka_helper.produce(topic, batch)
        ids.extend(m.message_id or "" for m in batch)
        return [m.message_id or "" for m in batch]

    zombie = bare_worker(db, spec, tmp_path, "zombie")
    heir: Process | None = None
    try:
        produce("a", 20)
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 60, "the first batch")
        (control / "arm-handler").touch()
        late = produce("b", 20)
        assert wait_held(control, zombie, "the zombie inside a handler") == zombie.pid
        zombie.process.send_signal(signal.SIGSTOP)

        heir = bare_worker(db, spec, tmp_path, "heir")
        heir_pid = str(heir.pid)
        wait_for(
            lambda: rows_by(db.engine, db.prefix, heir_pid, late) == len(late),
            60,
            "the heir to process the zombie's records",
        )
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 60, "offsets at the end")

        (control / "go").touch()
        zombie.process.send_signal(signal.SIGCONT)
        # A graceful stop finishes (tries to commit) the batch in flight, then exits.
        zombie.terminate()
        assert rows_by(db.engine, db.prefix, str(zombie.pid), late) == 0, zombie.log_tail()

        produce("c", 10)
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 60, "the last records")
    finally:
        (control / "go").touch()  # a held zombie stops at once
        zombie.terminate()
        code = heir.terminate() if heir is not None else 0
    assert code == 0, heir.log_tail() if heir else ""
    assert_final_state(db, kafka_helper, group, topic, ids)


def test_a_replay_of_a_processed_range_applies_nothing_again(
    kafka_helper: KafkaHelper, db: TestDatabase, base: dict[str, Any], tmp_path: Path
) -> None:
    """``mqdedup replay --from 5 --to 15`` over records already processed with offsets
    in the database: all 20 are duplicates, nothing is written, the offset rows and the
    group's offsets stay where they were."""
    topic = kafka_helper.create_topic(partitions=2)
    group = base["group"]
    spec = {**base, "topic": topic, "prefix": db.prefix}
    batch = messages("r", 40, 2)
    kafka_helper.produce(topic, batch)
    ids = [m.message_id or "" for m in batch]
    worker = bare_worker(db, spec, tmp_path, "worker")
    try:
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 60, "every record")
    finally:
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    before = offset_rows(db.engine, db.prefix, group, topic)

    replay = subprocess.run(
        [MQDEDUP, "replay", CONSUMER, "--from", "5", "--to", "15"],
        cwd=REPO,
        env=environment(db, spec),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert replay.returncode == 0, replay.stdout + replay.stderr[-3000:]
    counted = {
        label: int(value)
        for label, value in re.findall(r"^(new|duplicates)\b.*?(\d+)\s*$", replay.stdout, re.M)
    }
    assert counted == {"new": 0, "duplicates": 20}, replay.stdout
    assert offset_rows(db.engine, db.prefix, group, topic) == before
    assert_final_state(db, kafka_helper, group, topic, ids)


def bump_owner_epoch(engine: Engine, prefix: str, group: str, topic: str) -> None:
    """What another worker taking the partitions does to the offset rows."""
    table = Table(f"{prefix}kafka_offsets", MetaData(), autoload_with=engine)
    with engine.begin() as connection:
        connection.execute(
            update(table)
            .where(table.c.group_id == group, table.c.topic == topic)
            .values(owner_epoch=table.c.owner_epoch + 1)
        )


def test_fenced_batches_do_not_use_up_their_records_attempts(
    kafka_helper: KafkaHelper, db: TestDatabase, base: dict[str, Any], tmp_path: Path
) -> None:
    """A record whose batch is fenced three times in a row (each time another owner takes
    the offset row while the handler runs: its owner epoch bumped), with
    ``max_attempts = 2``, is processed once in the end. A fence is the framework's event,
    not the record's: it must not count as an attempt and dead-letter the record as "the
    worker died while handling it"."""
    topic = kafka_helper.create_topic(partitions=1)
    group = base["group"]
    control = Path(base["control"])
    spec = {**base, "topic": topic, "prefix": db.prefix, "max_attempts": 2}
    batch = messages("f", 1, 1)
    kafka_helper.produce(topic, batch)
    worker = bare_worker(db, spec, tmp_path, "worker")
    try:
        for fence in range(3):  # the first delivery, then max_attempts (2) redeliveries
            (control / "arm-handler").touch()
            wait_held(control, worker, f"fence {fence}: the worker inside the handler")
            bump_owner_epoch(db.engine, db.prefix, group, topic)
            (control / "go").touch()
            wait_for(lambda: not (control / "go").exists(), 30, "the worker to go on")
        wait_for(lambda: offsets_at_end(db, kafka_helper, group, topic), 60, "the record settled")
    finally:
        (control / "go").touch()
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    assert_final_state(db, kafka_helper, group, topic, [m.message_id or "" for m in batch])
