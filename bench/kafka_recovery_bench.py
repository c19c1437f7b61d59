"""Seconds from "the broker is ready again" to "the first new message is processed".

A PRIVATE Kafka broker (its own port and state dir, started with
``scripts/services.sh``) serves one 3-partition topic; a mqdedup ``KafkaConsumer``
(SQLite dedup store, default settings unless ``--kafka-config`` is given) consumes it
in a thread. Each run: the worker is mid-consume, the broker is killed with SIGKILL,
stays down ``--outage`` seconds, is started again (``services.sh start`` returns once a
metadata request answers: "ready"), new messages are produced, and the clock stops when
the worker has processed the first of them. Medians are printed.

Usage::

    .venv/bin/python bench/kafka_recovery_bench.py --runs 3 --outage 20
    .venv/bin/python bench/kafka_recovery_bench.py --kafka-config \\
        '{"reconnect_backoff_max_ms": 30000, "request_timeout_ms": 30000}'  # old defaults

The shared broker is never touched.

``--scenario crash`` / ``--scenario poison`` (issue 33) measure how fast the group
recovers from dead worker processes instead: ``mqdedup worker --processes 3`` (the
real supervisor, so each child gets its static ``group.instance.id``) drains a
6-partition topic on the shared Kafka into the shared PostgreSQL (fresh topic, group
and tables per run). ``crash``: 3,000 messages, a worker child killed with SIGKILL three
times (2 s apart after the previous restart was back at work); ``poison``: 500 messages,
one of which kills the process handling it (``os.kill(getpid(), SIGKILL)``) until it is
dead-lettered. The figure is the drain time: first message produced to the last row
committed. ``--client sync|async`` picks KafkaConsumer or AsyncKafkaConsumer (both on
the kafka-python transport since issue 41; on aiokafka before); ``--variant before``
runs them as before issue 33 (dynamic members; kafka-python's 45 s session timeout),
``after`` with today's defaults. ``--all`` runs every combination ``--runs`` times,
interleaved, and prints the medians side by side::

    .venv/bin/python bench/kafka_recovery_bench.py --all --runs 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kafka

from mqdedup import StopToken, create_engine, init_schema
from mqdedup.consumers.context import Context
from mqdedup.kafka import AsyncKafkaConsumer, KafkaConsumer
from mqdedup.message import Message

SERVICES = Path(__file__).resolve().parent.parent / "scripts" / "services.sh"


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 65000:
            return port


class Broker:
    """A private broker driven through scripts/services.sh."""

    def __init__(self, state_dir: Path) -> None:
        self.port = free_port()
        self.env = {**os.environ, "MQDEDUP_STATE_DIR": str(state_dir), "KAFKA_PORT": str(self.port)}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, action: str) -> None:
        subprocess.run(
            ["bash", str(SERVICES), action, "kafka"],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=300,
        )


class Recorder(KafkaConsumer):
    """Records when each message id was handled."""

    seen: ClassVar[dict[str, float]] = {}
    delay: ClassVar[float] = 0.0

    def handle(self, message: Message, ctx: Context) -> Any:
        self.seen.setdefault(str(message.id), time.monotonic())
        if self.delay:
            time.sleep(self.delay)
        return None


def produce(bootstrap: str, topic: str, ids: list[str]) -> None:
    producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for message_id in ids:
        producer.send(
            topic,
            value=b"x",
            key=message_id.encode(),
            headers=[("message-id", message_id.encode())],
        )
    producer.flush(30)
    producer.close(5)


def wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--outage", type=float, default=20.0)
    parser.add_argument("--kafka-config", default="{}", help="JSON merged into kafka_config")
    parser.add_argument("--scenario", choices=["outage", "crash", "poison"], default="outage")
    parser.add_argument("--client", choices=["sync", "async"], default="sync")
    parser.add_argument("--variant", choices=["before", "after"], default="after")
    parser.add_argument("--all", action="store_true", help="crash and poison, every variant")
    args = parser.parse_args()
    if args.all or args.scenario != "outage":
        crash_main(args)
        return
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # connection errors are expected
    extra = json.loads(args.kafka_config)

    with tempfile.TemporaryDirectory(prefix="mqdedup-recovery-") as tmp:
        broker = Broker(Path(tmp) / "services")
        broker.run("start")
        engine = create_engine(f"sqlite:///{tmp}/dedup.db")
        init_schema(engine, "b_")
        topic = f"recovery-{uuid.uuid4().hex[:8]}"
        admin = kafka.KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics({topic: {"num_partitions": 3}}, wait_for_metadata=True)
        admin.close()
        produce(broker.bootstrap, topic, [f"warm-{i}" for i in range(300)])

        consumer = type(
            "Bench",
            (Recorder,),
            {
                "topics": [topic],
                "group_id": f"g-{topic}",
                "table_prefix": "b_",
                "bootstrap_servers": broker.bootstrap,
                "batch_size": 50,
                "kafka_config": extra,
            },
        )
        stop = StopToken()
        thread = threading.Thread(target=lambda: consumer().run(engine, stop=stop), daemon=True)
        thread.start()
        wait(lambda: len(Recorder.seen) >= 300, 120, "the warm-up messages")
        figures: list[float] = []
        try:
            for run in range(args.runs):
                broker.run("kill")
                time.sleep(args.outage)
                broker.run("start")
                ready = time.monotonic()
                ids = [f"after-{run}-{i}" for i in range(30)]
                produce(broker.bootstrap, topic, ids)
                wait(lambda ids=ids: any(i in Recorder.seen for i in ids), 300, "a new message")
                first = min(Recorder.seen[i] for i in ids if i in Recorder.seen)
                figures.append(first - ready)
                wait(lambda ids=ids: all(i in Recorder.seen for i in ids), 120, "every new message")
                print(f"run {run + 1}: {figures[-1]:.1f} s from broker ready to first new message")
        finally:
            stop.request()
            thread.join(30)
            broker.run("stop")
        print(
            f"median {statistics.median(figures):.1f} s over {len(figures)} runs "
            f"(outage {args.outage:.0f} s, kill -9; kafka_config overrides: {extra or 'none'})"
        )


# -- crash recovery (issue 33) --------------------------------------------------------------

#: Handler time per message: 3,000 messages over 3 processes drain in ~5 s undisturbed.
CRASH_DELAY = 0.005


def _bench_settings() -> dict[str, Any]:
    return json.loads(os.environ["MQDEDUP_BENCH_CRASH"])


def _crash_namespace() -> dict[str, Any]:
    settings = _bench_settings()
    return {
        "topics": [settings["topic"]],
        "group_id": settings["group"],
        "batch_size": 50,
        "static_membership": settings["variant"] == "after",
        "kafka_config": (
            {"session_timeout_ms": 45_000, "heartbeat_interval_ms": 3_000}
            if settings["variant"] == "before" and settings["client"] == "sync"
            else {}
        ),
    }


def _rows_table(prefix: str) -> Any:
    from sqlalchemy import Column, MetaData, String, Table

    return Table(f"{prefix}rows", MetaData(), Column("message_id", String(64), primary_key=True))


def _kill_if_poison(message: Message) -> None:
    if message.id == "poison":
        os.kill(os.getpid(), 9)
    time.sleep(CRASH_DELAY)


class CrashSync(KafkaConsumer):
    """One row per message (kafka-python); ``poison`` kills its process."""

    def handle(self, message: Message, ctx: Context) -> Any:
        _kill_if_poison(message)
        table = _rows_table(_bench_settings()["prefix"])
        ctx.session.execute(table.insert().values(message_id=message.id))
        return None


class CrashAsync(AsyncKafkaConsumer):
    """One row per message (async handler); ``poison`` kills its process."""

    async def handle(self, message: Message, ctx: Any) -> Any:
        _kill_if_poison(message)
        table = _rows_table(_bench_settings()["prefix"])
        await ctx.session.execute(table.insert().values(message_id=message.id))
        return None


if "MQDEDUP_BENCH_CRASH" in os.environ:  # in the worker processes: configure the classes
    for _cls in (CrashSync, CrashAsync):
        for _key, _value in _crash_namespace().items():
            setattr(_cls, _key, _value)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _workers(supervisor: int) -> list[int]:
    """The supervisor's worker children (not multiprocessing's resource tracker)."""
    found = []
    for child in _children(supervisor):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(child)
    return found


def crash_run(scenario: str, client: str, variant: str, database: str, bootstrap: str) -> float:
    """One run: seconds from the first message produced to the last row committed."""
    from sqlalchemy import create_engine as sa_engine
    from sqlalchemy import func, select

    tag = uuid.uuid4().hex[:8]
    topic, prefix = f"crash-{tag}", f"cr{tag}_"
    settings = {
        "topic": topic,
        "group": f"g-{topic}",
        "prefix": prefix,
        "client": client,
        "variant": variant,
    }
    engine = sa_engine(database)
    init_schema(engine, prefix)
    rows = _rows_table(prefix)
    rows.metadata.create_all(engine)
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics({topic: {"num_partitions": 6}}, wait_for_metadata=True)
    admin.close()
    total = 3000 if scenario == "crash" else 500
    ids = [f"m{i:05d}" for i in range(total)]
    if scenario == "poison":
        ids[total // 5] = "poison"
    env = {
        **os.environ,
        "MQDEDUP_BENCH_CRASH": json.dumps(settings),
        "MQDEDUP_KAFKA_BOOTSTRAP": bootstrap,
        "PYTHONPATH": str(SERVICES.parent.parent),
    }
    target = "bench.kafka_recovery_bench:" + ("CrashSync" if client == "sync" else "CrashAsync")
    level = os.environ.get("MQDEDUP_BENCH_LOG_LEVEL", "WARNING")
    log_file = Path(tempfile.gettempdir()) / f"mqdedup-crash-{tag}.log"
    with log_file.open("w") as log_handle:
        worker = subprocess.Popen(
            [str(Path(sys.executable).parent / "mqdedup"), "worker", target, "--processes", "3",
             "--database", database, "--table-prefix", prefix, "--log-level", level,
             "--shutdown-timeout", "10"],
            env=env, stdout=log_handle, stderr=subprocess.STDOUT, cwd=SERVICES.parent.parent,
        )  # fmt: skip

        def count() -> int:
            with engine.connect() as connection:
                return int(connection.execute(select(func.count()).select_from(rows)).scalar_one())

        try:
            wait(lambda: len(_workers(worker.pid)) == 3, 60, "three worker processes")
            time.sleep(8)  # the group formed (rebalances of the start settled)
            started = time.monotonic()
            produce(bootstrap, topic, ids)
            expected = total - (1 if scenario == "poison" else 0)
            if scenario == "crash":
                for _ in range(3):
                    wait(lambda: count() > 0, 120, "rows")
                    time.sleep(2)
                    victims = _workers(worker.pid)
                    if victims and count() < expected:
                        os.kill(victims[0], 9)
                        wait(lambda: len(_workers(worker.pid)) == 3, 60, "the restarted child")
            wait(lambda: count() >= expected, 600, f"{expected} rows")
            elapsed = time.monotonic() - started
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
    with engine.begin() as connection:
        for table in reversed([*schema_tables(prefix), rows]):
            table.drop(connection, checkfirst=True)
    engine.dispose()
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.delete_topics([topic])
    admin.close()
    if level == "WARNING":
        log_file.unlink(missing_ok=True)
    return elapsed


def schema_tables(prefix: str) -> list[Any]:
    from mqdedup.db.schema import schema

    return list(schema(prefix).metadata.sorted_tables)


def crash_main(args: argparse.Namespace) -> None:
    database = os.environ.get("MQDEDUP_TEST_DATABASE_URL") or os.environ["MQDEDUP_DATABASE_URL"]
    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    scenarios = ["crash", "poison"] if args.all else [args.scenario]
    clients = ["sync", "async"] if args.all else [args.client]
    variants = ["before", "after"] if args.all else [args.variant]
    figures: dict[tuple[str, str, str], list[float]] = {}
    for run in range(args.runs):
        for scenario in scenarios:
            for client in clients:
                for variant in variants:
                    seconds = crash_run(scenario, client, variant, database, bootstrap)
                    figures.setdefault((scenario, client, variant), []).append(seconds)
                    print(
                        f"run {run + 1}: {scenario} {client} {variant}: {seconds:.1f} s",
                        flush=True,
                    )
    print("\n| scenario | client | before (s) | after (s) | runs |")
    print("|---|---|---|---|---|")
    for scenario in scenarios:
        for client in clients:
            cells = []
            for variant in ("before", "after"):
                values = figures.get((scenario, client, variant))
                cells.append(f"{statistics.median(values):.1f}" if values else "-")
            name = "KafkaConsumer" if client == "sync" else "AsyncKafkaConsumer"
            print(f"| {scenario} | {name} | {cells[0]} | {cells[1]} | {args.runs} |")


if __name__ == "__main__":
    main()
