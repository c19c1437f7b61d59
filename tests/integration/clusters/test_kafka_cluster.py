"""A three-broker Kafka cluster (RF=3, ``min.insync.replicas=2``) loses a broker mid-run.

Real ``mqdedup worker`` processes consume a 6-partition RF=3 topic while the broker that
leads most partitions is killed with SIGKILL and restarted, then the broker that
coordinates the group; the relay drains the outbox to an RF=3 topic while its partition
leader is killed. The cluster is started for this module and stopped after it
(``conftest.py``). Figures are printed as ``CLUSTER-FIGURES`` lines (``pytest -s``).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import and_, func, insert, or_, select

from mqdedup import Context, Message, RetryPolicy
from mqdedup.kafka import KafkaConsumer, KafkaPublisher
from mqdedup.outbox import Relay, RelayConfig
from tests.integration.clusters.kafka_tools import (
    busiest_leader,
    coordinator,
    describe,
    leaders,
    wait_in_sync,
)
from tests.integration.clusters.kafka_tools import (
    report as report_figures,
)
from tests.integration.clusters.support import CliWorker, Cluster
from tests.integration.kafka.helpers import row_counts, total_rows
from tests.integration.outbox.helpers import (
    OutboxDb,
    order_problems,
    relay_thread,
    write_keyed_rows,
)
from tests.services import (
    KafkaHelper,
    Outgoing,
    TestDatabase,
    kafka_headers,
    unique_name,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PARTITIONS = 6


@pytest.fixture
def helper(kafka_cluster: Cluster) -> Iterator[KafkaHelper]:
    kafka = KafkaHelper(kafka_cluster.kafka_bootstrap)
    yield kafka
    kafka.close()


class LiveTraffic:
    """Produces ``messages`` at ``rate`` per second from a thread (an idempotent ``acks=all``
    producer), as live traffic does: a kill lands while records are still being sent.

    Bodies are ``p<partition>-<send index, 6 digits>``, so a business row tells where and
    when its message was sent. ``positions``: message id -> [(partition, offset), ...].
    """

    def __init__(self, bootstrap: str, topic: str, messages: list[Outgoing], rate: float):
        import kafka

        self.producer = kafka.KafkaProducer(
            bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5
        )
        self.topic = topic
        self.messages = messages
        self.rate = rate
        self.sent = 0
        self.positions: dict[str, list[tuple[int, int]]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="live-traffic", daemon=True)

    def start(self) -> LiveTraffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        futures = []
        started = time.monotonic()
        try:
            for index, message in enumerate(self.messages):
                pause = started + index / self.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                body = f"p{message.partition}-{index:06d}".encode()
                future = self.producer.send(
                    self.topic,
                    value=body,
                    partition=message.partition,
                    headers=[("message-id", (message.message_id or "").encode())],
                )
                futures.append((message.message_id or "", future))
                self.sent = index + 1
            self.producer.flush(timeout=120)
            for message_id, future in futures:
                metadata = future.get(timeout=60)
                self.positions.setdefault(message_id, []).append(
                    (metadata.partition, metadata.offset)
                )
        except BaseException as error:
            self.error = error

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self.producer.close(timeout=10)
        assert not self._thread.is_alive(), "the producer did not finish"
        assert self.error is None, f"producing failed: {self.error!r}"


def rows_sent_after(db: TestDatabase, index: int, partitions: list[int] | None = None) -> int:
    """Business rows of messages sent after the ``index``-th (on ``partitions``, or any)."""
    table = orders_table(db.prefix)
    wanted = [
        and_(table.c.body.like(f"p{p}-%"), table.c.body > f"p{p}-{index:06d}")
        for p in (partitions if partitions is not None else range(PARTITIONS))
    ]
    with db.engine.connect() as connection:
        return int(
            connection.execute(
                select(func.count()).select_from(table).where(or_(*wanted))
            ).scalar_one()
        )


def seconds_until(condition: Callable[[], bool], since: float, what: str) -> float:
    """Seconds from ``since`` until ``condition()`` holds (bounded wait)."""
    wait_for(condition, 120, what, interval=0.05)
    return round(time.monotonic() - since, 2)


def committed_total(helper: KafkaHelper, group: str, topic: str) -> int:
    """The group's committed offsets, summed; -1 while the test's own client cannot ask
    (its request went to the broker just killed)."""
    from kafka.errors import KafkaError

    try:
        return sum(offset or 0 for offset in helper.committed(group, topic).values())
    except KafkaError:
        return -1


def led_by(helper: KafkaHelper, topic: str, partitions: list[int]) -> set[int]:
    """The leaders of ``partitions`` (empty while the metadata cannot be fetched)."""
    from kafka.errors import KafkaError

    try:
        found = leaders(helper.admin, topic)
    except KafkaError:
        return set()
    return {found[p] for p in partitions}


def with_duplicates(rng: random.Random, unique: int, copies: int) -> list[Outgoing]:
    """``unique`` messages plus ``copies`` re-sends of random ones, later, on any partition."""
    keyed = [
        (float(i), Outgoing(f"m-{i}", b"", partition=rng.randrange(PARTITIONS)))
        for i in range(unique)
    ]
    for index in rng.sample(range(unique), copies):
        keyed.append(
            (
                rng.uniform(index + 0.5, unique),
                Outgoing(f"m-{index}", b"", partition=rng.randrange(PARTITIONS)),
            )
        )
    return [message for _, message in sorted(keyed, key=lambda pair: pair[0])]


def test_workers_lose_the_busiest_leader_then_the_group_coordinator(
    kafka_cluster: Cluster, helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    topic = helper.create_topic(partitions=PARTITIONS)
    assert {len(p["replica_nodes"]) for p in describe(helper.admin, topic)} == {3}
    unique = 3_500
    messages = with_duplicates(random.Random(31), unique, 1_500)  # 5,000, 30% duplicates
    group = unique_name("cluster-group")
    env = {
        "MQDEDUP_TEST_CLUSTER_TARGET": topic,
        "MQDEDUP_TEST_CLUSTER_GROUP": group,
        "MQDEDUP_TEST_CLUSTER_PREFIX": db.prefix,
    }
    args = [
        "--database", db.url,
        "--table-prefix", db.prefix,
        "--kafka-bootstrap", kafka_cluster.kafka_bootstrap,
    ]  # fmt: skip
    consumer = "tests.integration.clusters.cluster_consumers:ClusterKafkaOrders"
    # Three supervisors of one group on one host: each its own static-membership host name.
    workers = [
        CliWorker(
            consumer,
            args,
            {**env, "MQDEDUP_INSTANCE_HOST": f"cluster-test-{n}"},
            tmp_path / f"worker{n}.log",
        )
        for n in range(3)
    ]
    traffic = LiveTraffic(kafka_cluster.kafka_bootstrap, topic, messages, rate=50.0)
    figures: dict[str, object] = {}
    try:
        traffic.start()
        wait_for(lambda: traffic.sent >= 500, 60, "500 messages sent")
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 250, 120, "the workers keeping up")
        for worker in workers:
            worker.ensure_alive()

        # 1. SIGKILL the broker leading most partitions, mid-run; restart it.
        victim, led = busiest_leader(helper.admin, topic)
        sent = traffic.sent
        killed_at = kafka_cluster.kill(victim)
        figures.update(leader_killed=victim, its_partitions=led, sent_at_leader_kill=sent)
        figures["first_new_message_on_its_partitions_s"] = seconds_until(
            lambda: rows_sent_after(db, sent, led) > 0,
            killed_at,
            "a message sent after the kill, to the dead leader's partitions, processed",
        )
        figures["new_leaders_s"] = seconds_until(
            lambda: bool(led_by(helper, topic, led)) and victim not in led_by(helper, topic, led),
            killed_at,
            "new leaders of the dead broker's partitions",
        )
        restarted_at = time.monotonic()
        kafka_cluster.start(victim)
        figures["broker_restart_s"] = round(time.monotonic() - restarted_at, 1)
        figures["back_in_sync_s"] = round(
            wait_in_sync(helper.admin, [topic, "__consumer_offsets"], 3, 120), 1
        )

        # 2. SIGKILL the broker coordinating the group, still mid-run; restart it.
        boss = coordinator(helper.admin, group)
        sent = traffic.sent
        assert sent < len(messages), "the traffic ended before the coordinator was killed"
        committed = committed_total(helper, group, topic)
        killed_at = kafka_cluster.kill(boss)
        figures.update(coordinator_killed=boss, sent_at_coordinator_kill=sent)
        figures["coordinator_first_new_message_s"] = seconds_until(
            lambda: rows_sent_after(db, sent) > 0, killed_at, "a message sent after the kill"
        )
        figures["first_commit_to_new_coordinator_s"] = seconds_until(
            lambda: committed_total(helper, group, topic) > committed,
            killed_at,
            "offsets committed to the new coordinator",
        )
        kafka_cluster.start(boss)

        traffic.join(timeout=180)
        wait_for(lambda: total_rows(db.engine, db.prefix) >= unique, 240, "every unique message")
        wait_for(
            lambda: committed_total(helper, group, topic) == len(messages),
            120,
            "the group's offsets at the end of every partition (lag 0)",
            interval=0.5,
        )
        for worker in workers:
            worker.ensure_alive()
    finally:
        codes = [worker.terminate() for worker in workers]
        report_figures("kafka-workers-timeline", **figures)
    assert codes == [0, 0, 0], [worker.log_tail() for worker in workers]
    assert sum(len(p) for p in traffic.positions.values()) == len(messages) == 5_000
    assert sum(helper.end_offsets(topic).values()) == 5_000  # committed == end: lag 0
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == set(traffic.positions), f"missing {unique - len(counts)}"
    doubled = {k: v for k, v in counts.items() if v != 1}
    assert not doubled, f"applied more than once: {list(doubled.items())[:5]}"
    dead_letter_topic = f"{topic}.DLT"
    if dead_letter_topic in helper.admin.list_topics():
        assert sum(helper.end_offsets(dead_letter_topic).values()) == 0
    report_figures(
        "kafka-workers", effects=len(counts), messages=5_000, doubled=0, dlt=0, **figures
    )


def test_relay_drains_5000_rows_while_the_partition_leader_is_killed(
    kafka_cluster: Cluster, helper: KafkaHelper, outbox_db: OutboxDb
) -> None:
    topic = helper.create_topic(partitions=PARTITIONS)
    written = write_keyed_rows(outbox_db, {"topic": topic}, keys=100, per_key=50, threads=4)
    assert sum(len(ids) for ids in written.values()) == 5_000

    class SlowRelay(Relay):
        """Pauses before marking each batch: the kill lands mid-drain on any machine."""

        def _before_mark(self, report: object) -> None:
            time.sleep(0.1)

    publisher = KafkaPublisher(kafka_cluster.kafka_bootstrap)
    relay = SlowRelay(
        outbox_db.engine,
        {"kafka": publisher},
        prefix=outbox_db.prefix,
        config=RelayConfig(batch_size=50, poll_interval=0.2, broker_backoff_max=1.0),
    )
    figures: dict[str, object] = {}
    with relay_thread(relay) as (_stop, _result):
        wait_for(lambda: outbox_db.status().pending <= 4_000, 120, "1,000 rows published")
        victim, _ = busiest_leader(helper.admin, topic)
        figures["pending_at_kill"] = outbox_db.status().pending
        killed_at = kafka_cluster.kill(victim)
        figures["leader_killed"] = victim
        wait_for(lambda: outbox_db.status().pending == 0, 240, "every row published")
        figures["drained_after_kill_s"] = round(time.monotonic() - killed_at, 1)
        kafka_cluster.start(victim)
    records = helper.read_all(topic, 5_000, timeout=120)  # partition by partition
    on_broker = sum(helper.end_offsets(topic).values())
    ids = Counter(kafka_headers(record)["message-id"] for record in records)
    assert set(ids) == {message_id for key_ids in written.values() for message_id in key_ids}
    doubled = {k: v for k, v in ids.items() if v != 1}
    assert on_broker == len(records) == 5_000 and not doubled, (
        on_broker,
        list(doubled.items())[:5],
    )
    payloads = [json.loads(record.value) for record in records]
    assert order_problems([(p["key"], p["seq"]) for p in payloads]) == []
    report_figures(
        "kafka-relay", rows=5_000, on_broker=on_broker, doubled=0, order_problems=0, **figures
    )


def in_process_consumer(
    bootstrap: str, topic: str, prefix: str, *, fail: str = "", delay: float = 0.0
) -> KafkaConsumer:
    """A consumer of ``topic`` writing ``<prefix>orders``; ids starting with ``fail`` fail
    every attempt (then go to the dead-letter topic)."""

    class Orders(KafkaConsumer):
        topics = (topic,)
        group_id = unique_name("cluster-inproc")
        bootstrap_servers = bootstrap
        table_prefix = prefix
        batch_size = 20
        retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05)

        def handle(self, message: Message, ctx: Context) -> None:
            if fail and (message.id or "").startswith(fail):
                raise ValueError("refused by the test")
            ctx.session.execute(
                insert(orders_table(prefix)).values(
                    message_id=message.id, body=message.body.decode(), worker="in-process"
                )
            )

        def after_commit(self, messages: Sequence[Message]) -> None:
            time.sleep(delay)

    return Orders()


def test_replay_and_dead_letters_go_on_while_a_leader_is_killed(
    kafka_cluster: Cluster, helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = helper.create_topic(partitions=3)
    ids = [f"{'bad' if i % 10 == 0 else 'ok'}-{i}" for i in range(1_500)]
    helper.produce(topic, [Outgoing(message_id, b"x") for message_id in ids])
    good = {i for i in ids if i.startswith("ok")}
    bad = {i for i in ids if i.startswith("bad")}
    figures: dict[str, object] = {}

    # 1. A replay of the whole range (it assigns partitions, commits nothing), with a
    #    dead-letter topic, while the broker leading most of its partitions is killed.
    consumer = in_process_consumer(
        kafka_cluster.kafka_bootstrap, topic, db.prefix, fail="bad", delay=0.05
    )
    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(consumer.replay(db.engine)))
    runner.start()
    try:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 200, 120, "the replay at work")
        dead_letter_topic = f"{topic}.DLT"
        wait_for(
            lambda: dead_letter_topic in helper.admin.list_topics(), 60, "the dead-letter topic"
        )
        victim, _ = busiest_leader(helper.admin, dead_letter_topic)
        figures["rows_at_kill"] = total_rows(db.engine, db.prefix)
        killed_at = kafka_cluster.kill(victim)
        figures["leader_killed"] = victim
        runner.join(240)
        figures["replay_done_after_kill_s"] = round(time.monotonic() - killed_at, 1)
    finally:
        runner.join(240)
        kafka_cluster.start(victim)
    assert not runner.is_alive() and len(outcome) == 1, "the replay did not finish"
    report = outcome[0]
    assert (report.new, report.dead_lettered) == (len(good), len(bad)), report
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == good and set(counts.values()) == {1}
    dead = Counter(
        kafka_headers(record)["message-id"]
        for record in helper.read_all(dead_letter_topic, len(bad), timeout=60)
    )
    assert set(dead) == bad, f"missing dead letters: {len(bad - set(dead))}"
    figures["dead_letter_copies"] = sum(dead.values()) - len(bad)
    report_figures("kafka-replay-dead-letters", new=report.new, dead=len(bad), **figures)
    assert figures["dead_letter_copies"] == 0, figures
