"""Recovery bounds of the Transport contract, the same on every transport (issue 33).

Each scenario runs on the consumers it concerns (sync and async: since issue 41 both
run on the one kafka-python / pika transport of their broker), through ``consumer.run`` (what a
``mqdedup worker`` child runs) or ``run_async`` (a host application's task), and asserts
the bound written in ``mqdedup/consumers/transport.py``:

* a stop request (stop token, ``task.cancel()``) during start-up against an unreachable
  broker ends within 2 s, cleanly (``run_async``: ``CancelledError``) — all four;
* ``connect_timeout`` is waited out by both Kafka clients before they give up;
* a stop while Kafka is down ends within 2 s (both Kafka clients; private broker);
* a Kafka outage is one WARNING when it starts and one INFO with its duration when it
  ends, and processing resumes (both Kafka clients; private broker);
* a stop while the RabbitMQ broker is down ends within 2 s, and the outage is one
  WARNING, not a line per reconnect attempt (sync and async; private node);
* a dead letter blocked by a memory alarm holds neither the acks nor the next batch:
  every good message is committed and acked during the alarm (private node);
* a channel the broker closes (``consumer_timeout``) is one WARNING with the reply code
  (406) and counted in ``channel_reopens`` (private node).

Scenarios that stop a broker or change its settings use the PRIVATE RabbitMQ node.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sqlalchemy import Table, func, insert, select

from mqdedup import AsyncConsumer, Consumer, Message, RetryPolicy, StopToken
from mqdedup.consumers.metrics import Metrics
from mqdedup.db import create_engine
from mqdedup.errors import BrokerUnavailableError
from tests.services import (
    KafkaHelper,
    Outgoing,
    PrivateRabbitMQ,
    RabbitAdmin,
    TestDatabase,
    free_port,
    prefixed_database,
    private_kafka,
    table_prefix,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration]

TRANSPORTS = ["kafka", "async-kafka", "rabbitmq", "async-rabbitmq"]
RABBIT_TRANSPORTS = ["rabbitmq", "async-rabbitmq"]
#: The Transport contract's bound on a stop, in any state.
STOP_BOUND = 2.0
FAST_RETRY = RetryPolicy(
    max_attempts=1, initial_backoff=0.01, max_backoff=0.02, infrastructure_backoff_max=1.0
)


class SyncOrders(Consumer):
    """One row per message; ``poison*`` ids fail; ``slow_once`` holds one message."""

    __test__ = False
    orders: ClassVar[Table]
    slow_once: ClassVar[dict[str, float]] = {}
    batch_size = 50
    poll_timeout = 0.2
    retry_policy = FAST_RETRY

    def handle(self, message: Message, ctx: Any) -> Any:
        assert message.id is not None
        if message.id.startswith("poison"):
            raise ValueError(f"cannot handle {message.id}")
        pause = type(self).slow_once.pop(message.id, None)
        if pause:
            time.sleep(pause)
        ctx.session.execute(insert(type(self).orders).values(message_id=message.id))
        return None


class AsyncOrders(AsyncConsumer):
    """:class:`SyncOrders` with ``async def handle``."""

    __test__ = False
    orders: ClassVar[Table]
    slow_once: ClassVar[dict[str, float]] = {}
    batch_size = 50
    poll_timeout = 0.2
    retry_policy = FAST_RETRY

    async def handle(self, message: Message, ctx: Any) -> Any:
        assert message.id is not None
        if message.id.startswith("poison"):
            raise ValueError(f"cannot handle {message.id}")
        pause = type(self).slow_once.pop(message.id, None)
        if pause:
            await asyncio.sleep(pause)
        await ctx.session.execute(insert(type(self).orders).values(message_id=message.id))
        return None


def consumer_class(kind: str, orders: Table, address: str, **attributes: Any) -> type[Any]:
    """A consumer of ``kind``'s transport at ``address`` (bootstrap or AMQP URL)."""
    name = f"parity-{uuid.uuid4().hex[:8]}"
    namespace: dict[str, Any] = {"orders": orders, "slow_once": {}}
    if kind in ("kafka", "async-kafka"):
        from mqdedup.kafka import AsyncKafkaConsumer, KafkaConsumer

        bases: tuple[type, ...] = (
            (SyncOrders, KafkaConsumer) if kind == "kafka" else (AsyncOrders, AsyncKafkaConsumer)
        )
        namespace.update(topics=[name], group_id=name, bootstrap_servers=address)
    else:
        from mqdedup.rabbitmq import AsyncRabbitMQConsumer, RabbitMQConsumer

        bases = (
            (SyncOrders, RabbitMQConsumer)
            if kind == "rabbitmq"
            else (AsyncOrders, AsyncRabbitMQConsumer)
        )
        namespace.update(queue=name, url=address, connection_name=f"mqdedup-{name}")
    namespace.update(attributes)
    return type(f"Parity{kind.title().replace('-', '')}", bases, namespace)


def unreachable(kind: str) -> str:
    port = free_port()
    if kind in ("kafka", "async-kafka"):
        return f"127.0.0.1:{port}"
    return f"amqp://guest:guest@127.0.0.1:{port}/%2F"


class Running:
    """``consumer.run(database, stop=...)`` in a thread, as a worker process runs it."""

    def __init__(self, consumer: Any, database: Any) -> None:
        self.stop = StopToken()
        self.metrics = Metrics()
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(consumer, database), name="parity-worker", daemon=True
        )
        self.thread.start()

    def _run(self, consumer: Any, database: Any) -> None:
        try:
            consumer.run(database, stop=self.stop, metrics=self.metrics)
        except BaseException as error:
            self.error = error

    def stop_and_time(self, limit: float = 60.0) -> float:
        """Request the stop; seconds until ``run`` returned."""
        asked = time.monotonic()
        self.stop.request()
        self.thread.join(limit)
        assert not self.thread.is_alive(), f"the worker did not stop within {limit} s"
        return time.monotonic() - asked


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Any]:
    engine = create_engine(f"sqlite:///{tmp_path / 'parity.db'}")
    yield engine
    engine.dispose()


@pytest.fixture
def orders_db(pg_url: str) -> Iterator[tuple[TestDatabase, Table]]:
    prefix = table_prefix()
    orders = orders_table(prefix)
    with prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as db:
        yield db, orders


def rows(db: TestDatabase, orders: Table) -> int:
    with db.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(orders)).scalar_one())


# -- start-up ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_stop_during_start_up_against_an_unreachable_broker_ends_within_2s(
    kind: str, sqlite_engine: Any
) -> None:
    consumer = consumer_class(
        kind, orders_table("p_"), unreachable(kind), connect_timeout=30.0, startup_timeout=30.0
    )()
    worker = Running(consumer, sqlite_engine)
    time.sleep(1.0)  # the worker is in its connect attempts (nothing to await: it fails)
    assert worker.thread.is_alive(), f"gave up at once: {worker.error!r}"
    took = worker.stop_and_time()
    print(f"{kind}: stop during start-up took {took:.2f} s")
    assert worker.error is None, f"a stop is not an error: {worker.error!r}"
    assert took < STOP_BOUND, f"{kind}: the stop took {took:.1f} s"


def test_sigterm_while_mqdedup_worker_waits_for_an_unreachable_broker_exits_0(
    tmp_path: Path,
) -> None:
    """The CLI's own wait for the broker (before it starts its processes) ends on
    SIGTERM with exit code 0 (it was killed by the signal: 143)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.services import REPO

    cli = str(Path(sys.executable).parent / "mqdedup")
    database = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "MQDEDUP_TEST_RABBIT_QUEUE": "parity-cli", "PYTHONPATH": str(REPO)}
    subprocess.run([cli, "db", "upgrade", "--database", database], env=env, check=True)
    command = [cli, "worker", "tests.integration.rabbitmq.cli_consumer:CliOrders"]
    command += ["--database", database, "--rabbitmq-url", unreachable("rabbitmq")]
    worker = subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stderr is not None
        line = worker.stderr.readline()  # blocks until the CLI says what it waits for
        assert "waiting up to" in line, line
        asked = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)
        took = time.monotonic() - asked
    finally:
        if worker.poll() is None:
            worker.kill()
    print(f"mqdedup worker: SIGTERM while waiting for RabbitMQ: exit {code} in {took:.2f} s")
    assert code == 0
    assert took < STOP_BOUND + 2.0, f"took {took:.1f} s (interpreter exit included)"


@pytest.mark.parametrize("kind", ["async-kafka", "async-rabbitmq"])
def test_task_cancel_during_start_up_ends_run_async_with_cancelled_error_within_2s(
    kind: str, tmp_path: Path
) -> None:
    consumer = consumer_class(
        kind, orders_table("p_"), unreachable(kind), connect_timeout=30.0, startup_timeout=30.0
    )()

    async def scenario() -> tuple[float, BaseException | None]:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'parity.db'}")
        task = asyncio.ensure_future(consumer.run_async(engine))
        await asyncio.sleep(1.0)
        assert not task.done(), f"gave up at once: {task.exception()!r}"
        cancelled = time.monotonic()
        task.cancel()
        outcome: BaseException | None = None
        try:
            await asyncio.wait_for(task, 60)
        except BaseException as error:
            outcome = error
        took = time.monotonic() - cancelled
        await engine.dispose()
        return took, outcome

    took, outcome = asyncio.run(scenario())
    print(f"{kind}: task.cancel() during start-up took {took:.2f} s ({outcome!r})")
    assert isinstance(outcome, asyncio.CancelledError), f"ended with {outcome!r}"
    assert took < STOP_BOUND, f"{kind}: the cancel took {took:.1f} s"


@pytest.mark.parametrize("kind", ["kafka", "async-kafka"])
def test_connect_timeout_is_waited_out_by_both_kafka_clients(kind: str) -> None:
    consumer = consumer_class(kind, orders_table("p_"), unreachable(kind), connect_timeout=4.0)()

    def start() -> Any:
        return consumer.create_transport(stop=StopToken())

    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError):
        if kind == "async-kafka":
            from mqdedup.bridge import run_bridged

            asyncio.run(run_bridged(start))
        else:
            start()
    took = time.monotonic() - started
    print(f"{kind}: gave up after {took:.1f} s (connect_timeout 4 s)")
    assert 3.0 <= took < 20.0, f"{kind} gave up after {took:.1f} s (connect_timeout 4 s)"


# -- broker down (private brokers) -------------------------------------------------------------


def start_both_kafka_clients(
    helper: KafkaHelper, bootstrap: str, db: TestDatabase, orders: Table
) -> tuple[dict[str, Any], dict[str, Running]]:
    """A KafkaConsumer and an AsyncKafkaConsumer, 20 messages each on a 2-partition topic,
    running until the 40 rows are committed; ``(consumers, workers)`` by kind."""
    consumers: dict[str, Any] = {}
    workers: dict[str, Running] = {}
    for kind in ("kafka", "async-kafka"):
        consumer = consumer_class(
            kind, orders, bootstrap, table_prefix=db.prefix, commit_interval=0.0
        )()
        helper.create_topic(partitions=2, name=consumer.topics[0])
        helper.produce(consumer.topics[0], [Outgoing(f"{kind}-{n:03d}", b"x") for n in range(20)])
        consumers[kind] = consumer
        workers[kind] = Running(consumer, db.engine)
    wait_for(lambda: rows(db, orders) == 40, 90, "the first messages committed")
    return consumers, workers


def kafka_lines(
    caplog: pytest.LogCaptureFixture, consumer: Any, level: int
) -> list[logging.LogRecord]:
    """mqdedup's records at ``level`` and above (exactly ``level`` for INFO) of ``consumer``."""
    return [
        r
        for r in caplog.records
        if r.name.startswith("mqdedup")
        and getattr(r, "consumer", None) == consumer.consumer_name
        and (r.levelno >= level if level >= logging.WARNING else r.levelno == level)
    ]


def outage_ends(caplog: pytest.LogCaptureFixture, consumer: Any) -> list[logging.LogRecord]:
    """The INFO lines that end an outage of ``consumer`` (they carry its duration)."""
    return [r for r in kafka_lines(caplog, consumer, logging.INFO) if hasattr(r, "outage_seconds")]


def test_a_stop_while_kafka_is_down_ends_within_2s_on_both_clients(
    tmp_path: Path, orders_db: tuple[TestDatabase, Table]
) -> None:
    """KafkaConsumer and AsyncKafkaConsumer side by side on one PRIVATE broker, killed
    with SIGKILL."""
    db, orders = orders_db
    with private_kafka(tmp_path / "services") as broker:
        helper = KafkaHelper(broker.bootstrap)
        try:
            _, workers = start_both_kafka_clients(helper, broker.bootstrap, db, orders)
        finally:
            # Not deleting the topic: that would rebalance the running consumers (revoke
            # commits failing) just before the stop being timed. The private broker goes.
            helper.close(delete_topics=False)
        broker.kill()
        time.sleep(3.0)  # down for a while: the clients are reconnecting
        for kind, worker in workers.items():
            took = worker.stop_and_time()
            print(f"{kind}: stop while Kafka is down took {took:.2f} s")
            assert worker.error is None, f"{kind}: a stop is not an error: {worker.error!r}"
            assert took < STOP_BOUND, f"{kind}: the stop during the outage took {took:.1f} s"
    assert rows(db, orders) == 40


def test_a_kafka_outage_is_one_warning_when_it_starts_and_one_info_with_its_duration_when_it_ends(
    tmp_path: Path,
    orders_db: tuple[TestDatabase, Table],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """KafkaConsumer and AsyncKafkaConsumer side by side on one PRIVATE broker, killed with SIGKILL
    and started again: both clients ride the outage out inside their poll; mqdedup logs
    one WARNING when it starts and one INFO with its duration when it ends (not a line
    per reconnect attempt), and processing resumes."""
    db, orders = orders_db
    caplog.set_level(logging.DEBUG, logger="mqdedup")
    with private_kafka(tmp_path / "services") as broker:
        helper = KafkaHelper(broker.bootstrap)
        try:
            consumers, workers = start_both_kafka_clients(helper, broker.bootstrap, db, orders)
            for kind, consumer in consumers.items():  # no offset commit in flight at the kill
                topic = consumer.topics[0]
                wait_for(
                    lambda topic=topic, group=consumer.group_id: (
                        helper.committed(group, topic) == helper.end_offsets(topic)
                    ),
                    30,
                    f"{kind}: the offsets committed",
                )
        finally:
            helper.close(delete_topics=False)  # the private broker goes anyway

        broker.kill()
        killed = time.monotonic()
        for kind, consumer in consumers.items():
            wait_for(
                lambda consumer=consumer: bool(kafka_lines(caplog, consumer, logging.WARNING)),
                30,
                f"{kind}: the outage noticed",
            )
            print(f"{kind}: outage WARNING {time.monotonic() - killed:.1f} s after the kill")
        time.sleep(3.0)  # the outage goes on: the clients keep reconnecting meanwhile
        broker.start()
        restarted = time.monotonic()
        down = restarted - killed
        helper = KafkaHelper(broker.bootstrap)
        try:
            for kind, consumer in consumers.items():
                helper.produce(
                    consumer.topics[0],
                    [Outgoing(f"{kind}-after-{n:03d}", b"x") for n in range(20)],
                )
        finally:
            helper.close(delete_topics=False)  # the private broker goes anyway
        wait_for(lambda: rows(db, orders) == 80, 90, "the messages after the outage committed")
        print(f"processing resumed {time.monotonic() - restarted:.1f} s after the restart")
        for kind, consumer in consumers.items():
            wait_for(
                lambda consumer=consumer: bool(outage_ends(caplog, consumer)),
                30,
                f"{kind}: the end of the outage logged",
            )
        for kind, consumer in consumers.items():
            warnings = [r.getMessage() for r in kafka_lines(caplog, consumer, logging.WARNING)]
            assert warnings == ["kafka unreachable; the client reconnects"], (
                f"{kind}: one WARNING when the outage starts, got {warnings}"
            )
            ends = outage_ends(caplog, consumer)
            assert len(ends) == 1, (
                f"{kind}: one INFO at the end, got {[r.getMessage() for r in ends]}"
            )
            seconds = getattr(ends[0], "outage_seconds")  # set through extra=
            print(f"{kind}: {ends[0].getMessage()} (broker down {down:.1f} s)")
            assert 0 < seconds <= time.monotonic() - killed, f"{kind}: outage of {seconds} s"

        for kind, worker in workers.items():
            worker.stop_and_time()
            assert worker.error is None, f"{kind}: {worker.error!r}"
    assert rows(db, orders) == 80


# -- RabbitMQ broker faults (private node) ----------------------------------------------------


def test_a_stop_while_the_broker_is_down_ends_within_2s_and_the_outage_is_one_warning(
    private_rabbit: PrivateRabbitMQ,
    orders_db: tuple[TestDatabase, Table],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RabbitMQConsumer and AsyncRabbitMQConsumer side by side (one broker kill: a node
    restart costs ~25 s)."""
    db, orders = orders_db
    admin = RabbitAdmin(private_rabbit.url)
    consumers = {}
    for kind in RABBIT_TRANSPORTS:
        consumer = consumer_class(kind, orders, private_rabbit.url, table_prefix=db.prefix)()
        admin.declare(consumer)
        admin.publish(consumer.queue, [f"{kind}-{n:03d}" for n in range(20)])
        consumers[kind] = consumer
    admin.close()
    caplog.set_level(logging.DEBUG, logger="mqdedup")
    workers = {kind: Running(consumer, db.engine) for kind, consumer in consumers.items()}
    wait_for(lambda: rows(db, orders) == 40, 60, "the first messages committed")

    private_rabbit.service.kill()
    for kind, worker in workers.items():
        wait_for(
            lambda worker=worker: worker.metrics.consumer_attached is False,
            30,
            f"{kind}: the lost connection noticed",
        )
    time.sleep(3.0)  # the outage goes on: several reconnect attempts fail meanwhile
    for kind, worker in workers.items():
        took = worker.stop_and_time()
        print(f"{kind}: stop while the broker is down took {took:.2f} s")
        assert worker.error is None, f"{kind}: a stop is not an error: {worker.error!r}"
        assert took < STOP_BOUND, f"{kind}: the stop during the outage took {took:.1f} s"
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING
            and r.name.startswith("mqdedup")
            and getattr(r, "queue", None) == consumers[kind].queue
        ]
        assert len(warnings) == 1, f"{kind}: one WARNING per outage, got {warnings}"
    assert rows(db, orders) == 40


@pytest.mark.parametrize("kind", RABBIT_TRANSPORTS)
def test_a_dead_letter_blocked_by_a_memory_alarm_holds_neither_acks_nor_the_next_batch(
    kind: str, private_rabbit: PrivateRabbitMQ, orders_db: tuple[TestDatabase, Table]
) -> None:
    db, orders = orders_db
    consumer = consumer_class(kind, orders, private_rabbit.url, table_prefix=db.prefix)()
    admin = RabbitAdmin(private_rabbit.url)
    admin.declare(consumer)
    # One poison per batch of 50: each waits for its blocked dead-letter publish.
    ids = [f"poison-{n}" if n % 50 == 7 else f"m-{n:04d}" for n in range(300)]
    admin.publish(consumer.queue, ids)
    admin.close()
    good = len([i for i in ids if not i.startswith("poison")])
    poisons = len(ids) - good

    private_rabbit.memory_alarm(True)
    alarm = time.monotonic()
    worker = Running(consumer, db.engine)
    try:
        # The sync transport gives a blocked dead letter up after 1 s: all good messages
        # are committed and acked within seconds. Before issue 33 the aio-pika stack waited
        # 30 s per blocked dead letter, holding the acks and the next batch.
        wait_for(
            lambda: (
                rows(db, orders) == good
                and private_rabbit.queue_messages(consumer.queue) == poisons
            ),
            40,
            "every good message committed and acked during the alarm",
        )
        print(
            f"{kind}: {good} good messages committed and acked "
            f"{time.monotonic() - alarm:.1f} s into the alarm ({poisons} blocked dead letters)"
        )
        assert worker.metrics.dead_lettered == 0, "nothing can be published during the alarm"
    finally:
        private_rabbit.memory_alarm(False)
        took = worker.stop_and_time()
    assert took < STOP_BOUND + 1.0, f"{kind}: the stop after the alarm took {took:.1f} s"


@pytest.mark.parametrize("kind", RABBIT_TRANSPORTS)
def test_a_channel_the_broker_closes_is_one_warning_with_its_reply_code_and_counted(
    kind: str,
    private_rabbit: PrivateRabbitMQ,
    orders_db: tuple[TestDatabase, Table],
    caplog: pytest.LogCaptureFixture,
) -> None:
    db, orders = orders_db
    private_rabbit.set_env("consumer_timeout", 2000)
    private_rabbit.set_env("channel_tick_interval", 500)
    consumer = consumer_class(
        kind, orders, private_rabbit.url, table_prefix=db.prefix, batch_size=10
    )()
    type(consumer).slow_once["m-005"] = 5.0  # longer than consumer_timeout
    admin = RabbitAdmin(private_rabbit.url)
    admin.declare(consumer)
    admin.publish(consumer.queue, [f"m-{n:03d}" for n in range(40)])
    admin.close()
    caplog.set_level(logging.INFO, logger="mqdedup")
    worker = Running(consumer, db.engine)
    try:
        wait_for(
            lambda: rows(db, orders) == 40 and private_rabbit.queue_messages(consumer.queue) == 0,
            60,
            "every message committed and acked after the channel was closed",
        )
        wait_for(lambda: worker.metrics.channel_reopens >= 1, 10, "the reopen counted")
    finally:
        worker.stop_and_time()
    warnings = [
        f"{r.getMessage()} {r.__dict__}"
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("mqdedup")
    ]
    # The held batch may outlast the reopened channel's timeout too: one line per close.
    assert 1 <= len(warnings) <= worker.metrics.channel_reopens, (
        f"{kind}: one WARNING per closed channel ({worker.metrics.channel_reopens} reopened), "
        f"got {warnings}"
    )
    for line in warnings:
        assert "406" in line and "PRECONDITION_FAILED" in line, line
