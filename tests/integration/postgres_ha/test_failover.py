"""A primary killed with ``kill -9`` mid-run and its streaming replica promoted, under a
real ``mqdedup worker`` and ``mqdedup relay`` on the shared Kafka (issue 30, items 2 and 3).

The database is a PRIVATE primary with its replica (``scripts/services.sh`` with its own
state dir and ports, ``pg-replica`` and ``pg-promote``); the worker's URL names both hosts
with ``target_session_attrs=read-write``. To make the failover's danger certain rather
than a race, the replica is cut off from the primary mid-run (its ``primary_conninfo``
emptied) before the kill: the standby lags, as one does under load or a slow network.

* Synchronous replication: the worker's commit waits for the standby (seen as a backend
  waiting on ``SyncRep``), the primary dies, the worker and the relay wait out the outage
  (health not ready), reconnect to the promoted replica, and every message's effect is
  there once with the committed offset at the end of the topic, and its outbox event
  (one per message) on the broker.
* Asynchronous replication: ``mqdedup worker`` and ``mqdedup db check`` warn at start;
  the primary acknowledges commits the standby never gets, the worker commits those
  messages' offsets, and after the failover they are lost for good. The test measures
  how many (and fails if none are: then the warning would be crying wolf).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import Engine

from mqdedup.db import create_engine, init_schema
from mqdedup.outbox import OutboxStore
from tests.integration.postgres_ha.support import (
    MQDEDUP,
    MqdedupWorker,
    PrimaryWithReplica,
    order_counts,
    total_orders,
    wait_rows,
    with_duplicates,
)
from tests.services import (
    KAFKA_SESSION_TIMEOUT_ENV,
    REPO,
    KafkaHelper,
    Outgoing,
    kill_session_timeout_ms,
    table_prefix,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MESSAGES = 1_300  # 30% of them duplicates
WORKER = "tests.integration.postgres_ha.consumers:KafkaOrders"


@dataclass
class Failover:
    """What one run measured."""

    unique: int
    counts: dict[str, int]
    lost: list[str]
    #: The relay's events on the broker: copies per incoming message id.
    published: Counter[str]
    promotion_to_first_row: float
    worker_log: str


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Callable[[bool], PrimaryWithReplica]]:
    """A private primary with its replica (synchronous or not); both killed at the end."""
    pairs: list[PrimaryWithReplica] = []

    def start(synchronous: bool) -> PrimaryWithReplica:
        pair = PrimaryWithReplica(tmp_path / "pg", synchronous=synchronous)
        pairs.append(pair)
        pair.start()
        return pair

    yield start
    for pair in pairs:
        pair.close()


def readiness_is(daemon: MqdedupWorker, ready: bool) -> bool:
    return daemon.health().get("ready") is ready


def waiting_on_sync_replication(engine: Engine) -> bool:
    with engine.connect() as connection:
        found = connection.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        )
        return int(found.scalar_one()) > 0


def run_failover(
    pair: PrimaryWithReplica, kafka: KafkaHelper, tmp_path: Path, *, synchronous: bool
) -> Failover:
    prefix = table_prefix()
    primary = create_engine(pair.primary_url)
    init_schema(primary, prefix)
    orders_table(prefix).metadata.create_all(primary)
    topic = kafka.create_topic(partitions=1, kind="failover")
    events = kafka.create_topic(partitions=1, kind="failover-events")
    group = f"group-{topic}"
    ids = with_duplicates(random.Random(30), MESSAGES, 0.3, "f")
    kafka.produce(topic, [Outgoing(message_id, b"{}") for message_id in ids])
    unique = len(set(ids))
    env = {
        **os.environ,
        "MQDEDUP_DATABASE_URL": pair.url,
        "MQDEDUP_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "HA_PREFIX": prefix,
        "HA_TOPIC": topic,
        "HA_GROUP": group,
        "HA_OUTBOX_TOPIC": events,
        "HA_PAUSE": "0.02",
        KAFKA_SESSION_TIMEOUT_ENV: str(kill_session_timeout_ms(kafka.bootstrap)),
    }
    worker = MqdedupWorker(WORKER, env, tmp_path / f"worker-{synchronous}.log")
    relay = MqdedupWorker(
        None, {**env, "MQDEDUP_TABLE_PREFIX": prefix}, tmp_path / f"relay-{synchronous}.log"
    )
    daemons = (worker, relay)
    promoted = create_engine(pair.replica_url)
    try:
        wait_rows(primary, prefix, 200, 90, "the worker under way")
        pair.cut_replication()
        if synchronous:  # the worker's commit waits for the standby that lags
            wait_for(lambda: waiting_on_sync_replication(primary), 30, "a commit waiting")
        else:  # the primary goes on alone; the worker commits offsets past the standby
            settled = kafka.committed(group, topic).get(0) or 0
            wait_for(
                lambda: (kafka.committed(group, topic).get(0) or 0) >= settled + 150,
                60,
                "offsets committed while the standby lags",
            )
        primary.dispose()
        pair.kill_primary()
        for daemon in daemons:  # both wait out the outage, and say so
            wait_for(partial(readiness_is, daemon, False), 30, "the daemon not ready")
        promoted_at = pair.promote()
        before = total_orders(promoted, prefix)
        wait_for(
            lambda: total_orders(promoted, prefix) > before,
            60,
            "a new message processed on the promoted replica",
            interval=0.02,
        )
        first_row = time.monotonic() - promoted_at
        wait_for(
            lambda: kafka.committed(group, topic) == kafka.end_offsets(topic),
            120,
            "the committed offset at the end of the topic",
        )
        outbox = OutboxStore(prefix)
        wait_for(lambda: outbox.status(promoted).pending == 0, 60, "the outbox published")
        for daemon in daemons:
            wait_for(partial(readiness_is, daemon, True), 30, "the daemon ready again")
        counts = order_counts(promoted, prefix)
    finally:
        codes = [daemon.stop() for daemon in daemons]  # the tables go with the instances
        promoted.dispose()
    assert codes == [0, 0], (worker.tail(), relay.tail())
    published = Counter(
        json.loads(record.value)["id"] for record in kafka.read_all(events, expected=len(counts))
    )
    return Failover(
        unique=unique,
        counts=counts,
        lost=sorted(set(ids) - set(counts)),
        published=published,
        promotion_to_first_row=first_row,
        worker_log=worker.log.read_text(errors="replace"),
    )


def test_synchronous_replication_a_primary_killed_mid_run_loses_and_doubles_nothing(
    replicated: Callable[[bool], PrimaryWithReplica], kafka_helper: KafkaHelper, tmp_path: Path
) -> None:
    pair = replicated(True)
    outcome = run_failover(pair, kafka_helper, tmp_path, synchronous=True)
    assert outcome.lost == []
    assert len(outcome.counts) == outcome.unique
    assert set(outcome.counts.values()) == {1}, "a message's effect twice"
    assert set(outcome.published) == set(outcome.counts), "every event published by the relay"
    assert "replicates asynchronously" not in outcome.worker_log
    print(
        f"\n[failover sync] {outcome.unique} unique of {MESSAGES} messages, "
        f"lost 0, doubled 0, promotion -> first new message processed "
        f"{outcome.promotion_to_first_row:.2f} s"
    )


def test_asynchronous_replication_is_warned_about_and_loses_settled_messages(
    replicated: Callable[[bool], PrimaryWithReplica], kafka_helper: KafkaHelper, tmp_path: Path
) -> None:
    pair = replicated(False)
    check = subprocess.run(
        [MQDEDUP, "db", "check", "--database", pair.url],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert "warning: the database replicates asynchronously to 1 standby(s)" in check.stdout
    assert "synchronous_standby_names" in check.stdout
    outcome = run_failover(pair, kafka_helper, tmp_path, synchronous=False)
    assert "replicates asynchronously" in outcome.worker_log  # the worker's start line
    assert set(outcome.counts.values()) == {1}, "a message's effect twice"
    # Settled (offset committed) on the old primary's word, never on the standby: gone.
    assert outcome.lost, "nothing lost: the standby did not lag as the test arranged"
    assert set(outcome.counts) <= set(outcome.published), "a kept effect's event unpublished"
    orphans = set(outcome.published) - set(outcome.counts)  # events of effects gone
    print(
        f"\n[failover async] {outcome.unique} unique of {MESSAGES} messages, lost for good "
        f"{len(outcome.lost)} (offsets committed, claims and effects gone with the primary), "
        f"{len(orphans)} of them with their outbox event already published, "
        f"doubled 0, promotion -> first new message processed "
        f"{outcome.promotion_to_first_row:.2f} s"
    )
