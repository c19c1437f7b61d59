"""A three-node RabbitMQ cluster with a quorum queue loses nodes; nothing is lost or doubled.

A real ``mqdedup worker`` consumes a quorum queue whose leader is on node 1 through a
connection to node 2 (``--rabbitmq-url`` lists node 2, 3, 1); node 1 is killed with
SIGKILL and restarted, then node 2. The async consumer (AsyncRabbitMQConsumer) on node 2
loses node 2 the same way. The relay publishes to the quorum queue while the node it is
connected to is killed. The cluster is started for this module and stopped
after it (``conftest.py``). Figures are printed as ``CLUSTER-FIGURES`` lines.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sqlalchemy import insert

from mqdedup import AsyncContext, Message, RetryPolicy
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.rabbitmq import AsyncRabbitMQConsumer, RabbitMQPublisher
from mqdedup.rabbitmq.topology import Topology, declare_topology
from mqdedup.stopping import StopToken
from tests.integration.clusters.kafka_tools import report
from tests.integration.clusters.support import CliWorker, Cluster
from tests.integration.kafka.helpers import row_counts, total_rows
from tests.integration.outbox.helpers import (
    OutboxDb,
    order_problems,
    relay_thread,
    write_keyed_rows,
)
from tests.services import RabbitAdmin, TestDatabase, unique_name, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

#: What the cluster consumer declares (tests/integration/clusters/cluster_consumers.py).
DELIVERY_LIMIT = {"x-delivery-limit": 20}
PREFETCH = 40  # ClusterRabbitOrders: batch_size 20, two batches


def rabbitmqctl(cluster: Cluster, node: int, *args: str) -> Any:
    """``rabbitmqctl -n <node> ARGS --formatter json``, parsed."""
    result = subprocess.run(
        ["rabbitmqctl", "-n", cluster.rabbitmq_nodes[node - 1], *args, "-q", "--formatter", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout or "null")


def queue_info(cluster: Cluster, node: int, queue: str) -> dict[str, Any]:
    rows = rabbitmqctl(cluster, node, "list_queues", "name", "leader", "online", "messages")
    [info] = [row for row in rows if row["name"] == queue]
    return dict(info)


def connection_ports(cluster: Cluster, node: int, name_part: str) -> list[int]:
    """The AMQP ports (so: the nodes) of the connections whose name contains ``name_part``."""
    rows = rabbitmqctl(cluster, node, "list_connections", "port", "client_properties")
    return [
        row["port"]
        for row in rows
        if any(
            key == "connection_name" and name_part in str(value)
            for key, _, value in row["client_properties"]
        )
    ]


@pytest.fixture
def declare(rabbitmq_cluster: Cluster) -> Iterator[Any]:
    """Declares quorum queues through node 1 (so node 1 leads them); deletes them after."""
    admin = RabbitAdmin(rabbitmq_cluster.rabbitmq_urls[0])
    made: list[str] = []

    def make(queue: str) -> RabbitAdmin:
        topology = Topology(queue=queue, queue_type="quorum", queue_arguments=DELIVERY_LIMIT)
        declare_topology(admin.channel(), topology)
        made.extend([queue, topology.dead_letter_queue])
        return admin

    yield make
    admin.delete(*made)
    admin.close()


def test_quorum_queue_consumer_loses_the_leader_node_then_its_own_node(
    rabbitmq_cluster: Cluster, declare: Any, db: TestDatabase, tmp_path: Path
) -> None:
    cluster = rabbitmq_cluster
    queue = unique_name("cluster-q")
    admin = declare(queue)
    assert queue_info(cluster, 1, queue)["leader"] == cluster.rabbitmq_nodes[0]
    rng = random.Random(31)
    unique = [f"r-{i}" for i in range(2_400)]
    ids = unique + [rng.choice(unique) for _ in range(600)]  # 3,000 messages, 20% copies
    rng.shuffle(ids)
    admin.publish(queue, ids)
    urls = cluster.rabbitmq_urls
    worker = CliWorker(
        "tests.integration.clusters.cluster_consumers:ClusterRabbitOrders",
        [
            "--database",
            db.url,
            "--table-prefix",
            db.prefix,
            "--rabbitmq-url",
            ",".join([urls[1], urls[2], urls[0]]),  # node 2 first
        ],
        {
            "MQDEDUP_TEST_CLUSTER_TARGET": queue,
            "MQDEDUP_TEST_CLUSTER_PREFIX": db.prefix,
            "MQDEDUP_TEST_CLUSTER_DELAY": "0.25",
        },
        tmp_path / "worker.log",
    )
    figures: dict[str, object] = {}
    rows = lambda: total_rows(db.engine, db.prefix)  # noqa: E731
    try:
        wait_for(lambda: rows() >= 300, 120, "300 messages processed")
        worker.ensure_alive()
        name = f"mqdedup:{queue}:"
        assert connection_ports(cluster, 3, name) == [5682], "the consumer is not on node 2"

        # 1. SIGKILL node 1, the quorum queue's leader; the consumer's node 2 stays.
        before = rows()
        killed_at = cluster.kill(1)
        wait_for(lambda: rows() > before + PREFETCH, 120, "deliveries after the kill")
        figures["leader_node_kill_to_new_deliveries_s"] = round(time.monotonic() - killed_at, 2)
        figures["new_leader"] = queue_info(cluster, 3, queue)["leader"]
        started = time.monotonic()
        cluster.start(1)
        figures["node1_restart_s"] = round(time.monotonic() - started, 1)

        # 2. SIGKILL node 2, the consumer's own node: it reconnects to node 3.
        before = rows()
        assert before < len(unique), "the run ended before node 2 was killed"
        killed_at = cluster.kill(2)
        wait_for(lambda: rows() > before + PREFETCH, 120, "deliveries after the kill")
        figures["own_node_kill_to_new_deliveries_s"] = round(time.monotonic() - killed_at, 2)
        figures["reconnected_to_port"] = connection_ports(cluster, 1, name)
        cluster.start(2)

        wait_for(lambda: rows() >= len(unique), 240, "every unique message")
        wait_for(lambda: queue_info(cluster, 1, queue)["messages"] == 0, 60, "the queue empty")
        worker.ensure_alive()
    finally:
        code = worker.terminate()
        report("rabbitmq-consumer-timeline", **figures)
    assert code == 0, worker.log_tail()
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == set(unique), f"missing {len(set(unique) - set(counts))}"
    doubled = {k: v for k, v in counts.items() if v != 1}
    assert not doubled, f"applied more than once: {list(doubled.items())[:5]}"
    assert queue_info(cluster, 1, queue)["messages"] == 0
    assert queue_info(cluster, 1, f"{queue}.dlq")["messages"] == 0
    report("rabbitmq-consumer", messages=3_000, effects=len(counts), doubled=0, **figures)


class AsyncClusterOrders(AsyncRabbitMQConsumer):
    """One order row per message through the AsyncSession; ``poison-*`` ids always fail."""

    __test__ = False
    queue = "set-by-the-test"
    queue_type = "quorum"
    queue_arguments: ClassVar[dict[str, Any]] = DELIVERY_LIMIT
    batch_size = 20
    reconnect_interval = 0.5
    poll_timeout = 0.2
    retry_policy = RetryPolicy(max_attempts=1, initial_backoff=0.01, max_backoff=0.02)

    async def handle(self, message: Message, ctx: AsyncContext) -> Any:
        if (message.id or "").startswith("poison-"):
            raise ValueError(f"cannot handle {message.id}")
        await asyncio.sleep(0.01)  # so the kill lands mid-run on any machine
        await ctx.session.execute(
            insert(orders_table(self.table_prefix)).values(
                message_id=message.id, body=message.text()[:255]
            )
        )


def test_async_consumer_loses_its_node_and_reconnects_to_the_next(
    rabbitmq_cluster: Cluster, declare: Any, db: TestDatabase
) -> None:
    """AsyncRabbitMQConsumer connected to node 2 (a quorum queue led by node 1); node 2 is SIGKILLed
    mid-run and restarted: the consumer goes on through node 3, each effect once, the
    poison messages dead-lettered through the next node, the queue empty."""
    cluster = rabbitmq_cluster
    queue = unique_name("cluster-async")
    admin = declare(queue)
    assert queue_info(cluster, 1, queue)["leader"] == cluster.rabbitmq_nodes[0]
    rng = random.Random(3131)
    unique = [f"a-{i}" for i in range(1_200)]
    poison = [f"poison-{i}" for i in range(6)]
    ids = unique + [rng.choice(unique) for _ in range(300)]  # 1,500 messages, 20% copies
    rng.shuffle(ids)
    ids[600:600] = poison[:3]  # before and after the kill
    ids[1_200:1_200] = poison[3:]
    admin.publish(queue, ids)
    urls = cluster.rabbitmq_urls
    name = f"mqdedup-async-cluster:{queue}"
    consumer = type(
        "AsyncClusterOrdersRun",
        (AsyncClusterOrders,),
        {
            "queue": queue,
            "url": [urls[1], urls[2], urls[0]],  # node 2 first, as a list
            "table_prefix": db.prefix,
            "connection_name": name,
        },
    )()
    stop = StopToken()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["metrics"] = consumer.run(db.engine, stop=stop)
        except BaseException as error:
            outcome["error"] = error

    runner = threading.Thread(target=run, name="async-cluster-consumer", daemon=True)
    figures: dict[str, object] = {}
    rows = lambda: total_rows(db.engine, db.prefix)  # noqa: E731
    runner.start()
    try:
        wait_for(lambda: rows() >= 200 or "error" in outcome, 120, "200 messages processed")
        assert "error" not in outcome, outcome
        assert connection_ports(cluster, 1, name) == [5682], "the consumer is not on node 2"

        before = rows()
        killed_at = cluster.kill(2)
        wait_for(lambda: rows() > before + PREFETCH, 120, "deliveries after the kill")
        figures["own_node_kill_to_new_deliveries_s"] = round(time.monotonic() - killed_at, 2)
        figures["reconnected_to_port"] = connection_ports(cluster, 1, name)
        assert before < len(unique), "the run ended before node 2 was killed"
        started = time.monotonic()
        cluster.start(2)
        figures["node2_restart_s"] = round(time.monotonic() - started, 1)

        wait_for(lambda: rows() >= len(unique), 180, "every unique message")
        wait_for(lambda: queue_info(cluster, 1, queue)["messages"] == 0, 60, "the queue empty")
    finally:
        stop.request()
        runner.join(60)
        report("rabbitmq-async-consumer-timeline", **figures)
    assert not runner.is_alive(), "the consumer did not stop"
    assert "error" not in outcome, outcome
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == set(unique), f"missing {len(set(unique) - set(counts))}"
    doubled = {k: v for k, v in counts.items() if v != 1}
    assert not doubled, f"applied more than once: {list(doubled.items())[:5]}"
    assert 5683 in figures["reconnected_to_port"], figures  # type: ignore[operator]
    dead = admin.drain(f"{queue}.dlq", len(poison), timeout=60)
    dead_ids = Counter(properties.message_id for properties, _ in dead)
    assert set(dead_ids) == set(poison), dead_ids
    figures["dead_letter_copies"] = sum(dead_ids.values()) - len(poison)
    assert queue_info(cluster, 1, queue)["messages"] == 0
    report("rabbitmq-async-consumer", messages=len(ids), effects=len(counts), doubled=0, **figures)


def test_relay_publishes_3000_rows_while_its_node_is_killed(
    rabbitmq_cluster: Cluster, declare: Any, outbox_db: OutboxDb
) -> None:
    cluster = rabbitmq_cluster
    queue = unique_name("cluster-relay")
    admin = declare(queue)
    written = write_keyed_rows(
        outbox_db, {"exchange": "", "routing_key": queue}, keys=60, per_key=50, threads=4
    )
    assert sum(len(ids) for ids in written.values()) == 3_000

    class SlowRelay(Relay):
        """Pauses before marking each batch: the kill lands mid-run on any machine."""

        def _before_mark(self, report: object) -> None:
            time.sleep(0.1)

    urls = cluster.rabbitmq_urls
    publisher = RabbitMQPublisher(",".join([urls[1], urls[2], urls[0]]))  # node 2 first
    relay = SlowRelay(
        outbox_db.engine,
        {"rabbitmq": publisher},
        prefix=outbox_db.prefix,
        config=RelayConfig(batch_size=50, poll_interval=0.2, broker_backoff_max=1.0),
    )
    figures: dict[str, object] = {}
    with relay_thread(relay):
        wait_for(lambda: outbox_db.status().pending <= 2_000, 120, "1,000 rows published")
        assert connection_ports(cluster, 1, "mqdedup-relay:") == [5682]
        figures["pending_at_kill"] = outbox_db.status().pending
        killed_at = cluster.kill(2)
        wait_for(lambda: outbox_db.status().pending == 0, 240, "every row published")
        figures["drained_after_kill_s"] = round(time.monotonic() - killed_at, 1)
        figures["reconnected_to_port"] = connection_ports(cluster, 1, "mqdedup-relay:")
    cluster.start(2)
    messages = admin.drain(queue, 3_000, timeout=120)
    delivered = Counter(properties.message_id for properties, _ in messages)
    expected = {message_id for key_ids in written.values() for message_id in key_ids}
    assert set(delivered) == expected, f"missing {len(expected - set(delivered))}"
    copies = sum(delivered.values()) - len(expected)
    payloads = [json.loads(body) for _, body in messages]
    assert order_problems([(p["key"], p["seq"]) for p in payloads]) == []
    figures["copies_in_queue"] = copies
    report("rabbitmq-relay", rows=3_000, in_queue=sum(delivered.values()), **figures)
    # Records whose confirm died with the node are sent again (never taken as
    # published): at most the batch in flight can be there twice.
    assert copies <= 50, figures
