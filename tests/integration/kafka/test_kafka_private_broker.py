"""On a PRIVATE broker started with ``auto.create.topics.enable=false`` (issue 18).

One broker for the module (``KAFKA_AUTO_CREATE_TOPICS=false`` of scripts/services.sh):

* a dead-letter topic that does not exist and may not be created: a clear error naming
  the topic, the message kept in the database, the others processed;
* kill -9 of the broker mid-consume, down longer than the clients' request timeout (so
  the requests in flight time out and reconnects back off to their maximum): consumption
  resumes within seconds of the broker being ready again;
* relay rows for a topic that does not exist fail alone, with that reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from mqdedup import RetryPolicy
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.kafka import KafkaPublisher
from mqdedup.outbox import OutboxStore, OutboxWriter, Relay, RelayConfig
from tests.integration.kafka.consumers import make_consumer
from tests.integration.kafka.helpers import row_counts, total_rows
from tests.integration.kafka.test_kafka_refusals import running
from tests.services import (
    KafkaHelper,
    Outgoing,
    PrivateService,
    TestDatabase,
    private_kafka,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Consumption usually resumes within ~10 s of the broker being ready (median 0.2 s in
#: bench/kafka_recovery_bench.py); a group rejoin on a loaded machine took 22 s once, so
#: the test's bound is generous (docs/kafka.md).
RECOVERY_BOUND = 22.5
#: mqdedup's ``request_timeout_ms`` for the clients it creates (docs/kafka.md) ...
REQUEST_TIMEOUT = 10.0
#: ... which the broker outage outlasts (and the 1 s reconnect back-off many times over).
OUTAGE_SECONDS = REQUEST_TIMEOUT + 2.0


@dataclass(frozen=True)
class StrictBroker:
    service: PrivateService
    bootstrap: str


@pytest.fixture(scope="module")
def strict_kafka(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrictBroker]:
    """A private broker without topic auto-creation."""
    state = tmp_path_factory.mktemp("strict") / "services"
    with private_kafka(state, KAFKA_AUTO_CREATE_TOPICS="false") as broker:
        yield StrictBroker(broker, broker.bootstrap)


def test_a_missing_dead_letter_topic_that_cannot_be_created_keeps_the_message(
    strict_kafka: StrictBroker, db: TestDatabase
) -> None:
    helper = KafkaHelper(strict_kafka.bootstrap)
    try:
        topic = helper.create_topic(partitions=1)
        messages = [Outgoing(f"m-{i}", b"ok", partition=0) for i in range(10)]
        messages.insert(5, Outgoing("poison", b"cannot be handled", partition=0))
        helper.produce(topic, messages)
        group = unique_name("group")
        consumer = make_consumer(
            topic=topic,
            group=group,
            prefix=db.prefix,
            bootstrap=strict_kafka.bootstrap,
            bulk=False,
            fail_ids=frozenset({"poison"}),
            create_dead_letter_topics=False,
            retry_policy=RetryPolicy(max_attempts=2, initial_backoff=0.05, max_backoff=0.1),
        )
        table = DeadLetterTable(db.prefix)

        def parked() -> list:  # type: ignore[type-arg]
            with Session(db.engine) as session:
                return table.list(session)

        with running(consumer, db) as result:
            wait_for(lambda: len(parked()) == 1, 60, "the poison kept in the database")
            wait_for(lambda: total_rows(db.engine, db.prefix) >= 10, 30, "the other messages")
            wait_for(
                lambda: helper.committed(group, topic) == helper.end_offsets(topic),
                30,
                "lag 0",
            )
        [kept] = parked()
        assert kept.message.id == "poison" and kept.message.body == b"cannot be handled"
        assert f"'{topic}.DLT'" in kept.refusal  # the error names the topic ...
        assert "does not exist" in kept.refusal  # ... and what is wrong with it
        assert f"{topic}.DLT" not in set(helper.admin.list_topics())  # nothing auto-created
        assert row_counts(db.engine, db.prefix) == {f"m-{i}": 1 for i in range(10)}
        assert result[0].dead_letters_parked == 1
    finally:
        helper.close()


def test_consumption_resumes_within_seconds_of_a_killed_broker_being_ready_again(
    strict_kafka: StrictBroker, db: TestDatabase
) -> None:
    broker = strict_kafka.service
    helper = KafkaHelper(strict_kafka.bootstrap)
    topic = helper.create_topic(partitions=3)
    helper.produce(topic, [Outgoing(f"o-{i}", b"before", partition=i % 3) for i in range(1_500)])
    helper.close(delete_topics=False)
    group = unique_name("group")
    consumer = make_consumer(
        topic=topic, group=group, prefix=db.prefix, bootstrap=strict_kafka.bootstrap, delay=0.05
    )
    with running(consumer, db) as result:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 300, 60, "the first rows")
        broker.kill()
        rows_at_kill = total_rows(db.engine, db.prefix)
        time.sleep(OUTAGE_SECONDS)  # the outage itself: nothing to wait for
        assert rows_at_kill < 1_500, "the run ended before the kill"
        broker.start()  # returns once the broker answers a metadata request
        ready = time.monotonic()
        helper = KafkaHelper(strict_kafka.bootstrap)
        helper.created.append(topic)
        helper.produce(topic, [Outgoing(f"n-{i}", b"after", partition=i % 3) for i in range(30)])
        wait_for(
            lambda: any(key.startswith("n-") for key in row_counts(db.engine, db.prefix)),
            RECOVERY_BOUND * 4,
            "a message produced after the restart",
        )
        took = time.monotonic() - ready
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 1_530, 120, "every message")
        wait_for(lambda: helper.committed(group, topic) == helper.end_offsets(topic), 60, "lag 0")
    helper.close()
    print(f"first new message processed {took:.1f} s after the broker was ready")
    assert took < RECOVERY_BOUND * 2, f"resumed {took:.1f} s after the broker was ready"
    counts = row_counts(db.engine, db.prefix)
    assert len(counts) == 1_530 and set(counts.values()) == {1}
    assert result[0].dead_lettered == 0  # an outage never poisons messages


def test_relay_rows_for_a_topic_that_does_not_exist_fail_alone(
    strict_kafka: StrictBroker, db: TestDatabase
) -> None:
    helper = KafkaHelper(strict_kafka.bootstrap)
    try:
        topic = helper.create_topic(partitions=2)
        missing = unique_name("missing")
        with Session(db.engine) as session, session.begin():
            writer = OutboxWriter(session, prefix=db.prefix)
            good = [writer.publish({"n": n}, topic=topic, key=f"k{n}") for n in range(20)]
            lost = writer.publish({"n": "lost"}, topic=missing, key="elsewhere")
        relay = Relay(
            db.engine,
            {"kafka": KafkaPublisher(strict_kafka.bootstrap, metadata_timeout=2.0)},
            prefix=db.prefix,
            config=RelayConfig(max_attempts=2, initial_backoff=0.05, max_backoff=0.1),
        )
        try:
            wait_for(
                lambda: relay.drain(timeout=30) is not None and relay.status().failed == 1,
                60,
                "the row for the missing topic to fail",
            )
        finally:
            relay.close()
        status = relay.status()
        assert (status.published, status.failed, status.pending) == (20, 1, 0)
        table = OutboxStore(db.prefix).table
        with db.engine.connect() as connection:
            [(message_id, error)] = connection.execute(
                select(table.c.message_id, table.c.last_error).where(table.c.state == "failed")
            ).all()
        assert message_id == lost and f"'{missing}' does not exist" in error
        records = helper.read_all(topic, expected=20, timeout=20)
        assert {dict(r.headers)["message-id"].decode() for r in records} == set(good)
        assert missing not in set(helper.admin.list_topics())
    finally:
        helper.close()
