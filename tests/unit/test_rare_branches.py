"""The branches that rarely run: a stop during an outage or a retry back-off, a refused
dead letter that cannot be parked either, a relay batch that did not publish completely,
and the relay's Kafka producer settings.

Each test fails when its branch is changed in the way named in its docstring (issue #39:
the mutation run in ``bench/mutation.py`` found no test that caught these). SQLite and
the in-memory broker: the faults are staged through the consumer, the transport or the
publisher, which a real broker cannot do on demand.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import kafka
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session

from mqdedup import InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.consumers.dead_lettering import DeadLettering
from mqdedup.consumers.memory import MemoryTransport
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import BatchAbandonedError, Processor
from mqdedup.consumers.report import BatchReport
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.db.engine import session_factory
from mqdedup.db.schema import schema
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.errors import DeadLetterRefusedError
from mqdedup.outages import Outages
from mqdedup.outbox import MemoryPublisher, OutboxWriter, Relay, RelayConfig
from mqdedup.outbox.publishers import OutboxRecord, PublishOutcome, PublishResult
from mqdedup.stopping import StopToken
from tests.support import OrderConsumer, order_counts

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.01)
#: A back-off no test waits out: a stop requested meanwhile must end it.
LONG_BACKOFF = RetryPolicy(max_attempts=3, initial_backoff=60.0, max_backoff=60.0)


def publish_orders(broker: InMemoryBroker, count: int, queue: str = "orders") -> None:
    for number in range(count):
        broker.publish(
            queue, json.dumps({"order": number, "amount": number}), message_id=f"m{number}"
        )


def redeliver_all(broker: InMemoryBroker, queue: str = "orders") -> None:
    """Hand every queued message out once and give it back: each comes again flagged
    redelivered (careful mode then runs them one at a time, their attempts counted)."""
    transport = broker.transport(queue)
    transport.give_back(transport.fetch(1000, 0.1))


def settled(broker: InMemoryBroker, queue: str = "orders") -> int:
    return broker.settled_count.get(queue, 0)


# -- the Processor: a stop during an outage ------------------------------------------------


def test_a_stop_during_an_outage_settles_what_committed_but_no_unsent_dead_letter(
    sqlite_engine: Engine,
) -> None:
    """Mutation caught: ``Processor._settle_committed`` settling ``report.settled``
    (which includes the batch's dead letters) instead of its processed and duplicate
    deliveries. The id-less message is dead-lettered when the batch *ends*; a batch
    abandoned before that must not ack it, or it is lost without reaching the
    dead-letter queue."""

    class Outage(OrderConsumer):
        failure_isolation = "transaction"  # m0..m4 commit one by one before the outage
        retry_policy = FAST_RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "m5":
                worker.stop.request()
                raise DisconnectionError("database went away")  # an outage: never the message's
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    broker.publish("orders", b'{"order": "no id"}')  # no message id: a dead letter
    publish_orders(broker, 10)
    worker = Worker(Outage(), broker.transport("orders"), sqlite_engine)
    worker.run()

    assert worker.metrics.database_retries >= 1  # the outage was waited on, then abandoned
    assert settled(broker) == 5, "only the five committed messages are acked"
    assert "orders" not in broker.dead_letters
    assert broker.pending("orders") == 6  # the id-less one and m5..m9 come again

    run_until_idle(OrderConsumer(), broker.transport("orders"), sqlite_engine)
    dead = broker.dead_letters["orders"]
    assert [d.message.body for d in dead] == [b'{"order": "no id"}']
    assert "message id" in dead[0].record.reason
    assert sorted(order_counts(sqlite_engine).values()) == [1] * 10
    assert broker.pending("orders") == 0


def test_a_stop_while_the_database_is_down_never_acks_what_was_left_for_the_next_owner(
    sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation caught: ``Processor._settle_committed`` settling ``report.unsettled``
    (or ``report.settled``) when a batch is abandoned: the messages a stop left unrun
    would be acked with no effect."""

    class StopAtM1(OrderConsumer):
        failure_isolation = "transaction"
        retry_policy = FAST_RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "m1":
                processor.stop.request()  # m2..m4 are left unrun for the next owner
                raise RuntimeError("m1 failed")
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish_orders(broker, 5)
    transport = broker.transport("orders")
    processor = Processor(StopAtM1(), session_factory(sqlite_engine), transport)

    def database_down(*args: Any) -> int:
        raise DisconnectionError("database went away")  # counting m1's failure: an outage

    monkeypatch.setattr(processor.store, "record_failure", database_down)
    with pytest.raises(BatchAbandonedError):
        processor.process(transport.fetch(10, 0.1))

    assert order_counts(sqlite_engine) == {"m0": 1}
    assert settled(broker) == 1 and transport.in_flight == 4  # m1..m4 stay with the broker
    transport.close()
    monkeypatch.undo()
    run_until_idle(OrderConsumer(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in range(5)}


def test_careful_mode_dead_letters_a_malformed_message_at_its_first_failure(
    sqlite_engine: Engine,
) -> None:
    """Mutation caught: careful mode (``Processor._careful_one``) retrying a message
    error (a body that is not JSON) like a handler error: the message's own failure is
    final, its handler does not run again."""
    runs: list[str] = []

    class Counting(OrderConsumer):
        retry_policy = FAST_RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            runs.append(str(message.id))
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    broker.publish("orders", b"not json", message_id="bad")
    publish_orders(broker, 2)
    redeliver_all(broker)
    run_until_idle(Counting(), broker.transport("orders"), sqlite_engine)

    assert runs.count("bad") == 1
    (dead,) = broker.dead_letters["orders"]
    assert dead.record.attempts == 1 and "invalid JSON" in dead.record.reason
    assert order_counts(sqlite_engine) == {"m0": 1, "m1": 1}


# -- the Processor: a stop during a retry back-off -----------------------------------------


@pytest.mark.parametrize("redelivered", [False, True], ids=["first-delivery", "careful-mode"])
def test_a_message_stopped_in_its_retry_backoff_stays_unsettled_and_runs_again(
    sqlite_engine: Engine, redelivered: bool
) -> None:
    """Mutation caught: the retry loop (``Processor._retry``) or careful mode
    (``Processor._careful_one``, the redelivered case) reporting a message stopped during
    its back-off as processed or as a duplicate: it would be acked with no effect."""
    runs: list[str] = []

    class FailsOnce(OrderConsumer):
        retry_policy = LONG_BACKOFF

        def handle(self, message: Message, ctx: Context) -> Any:
            runs.append(str(message.id))
            if message.id == "m1" and runs.count("m1") == 1:
                worker.stop.request()  # the stop arrives while m1 waits for its retry
                raise RuntimeError("m1 failed once")
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish_orders(broker, 3)
    if redelivered:
        redeliver_all(broker)
    worker = Worker(FailsOnce(), broker.transport("orders"), sqlite_engine)
    worker.run()

    assert runs.count("m1") == 1, "the stop ended the back-off: no second run"
    assert "m1" not in order_counts(sqlite_engine)
    assert "orders" not in broker.dead_letters
    acked = settled(broker)
    assert acked == len(order_counts(sqlite_engine)), "every acked message has its effect"
    assert broker.pending("orders") == 3 - acked  # m1 (careful mode: m2 too) comes again
    attempts = schema().attempts
    with sqlite_engine.connect() as connection:
        counted = connection.execute(
            select(attempts.c.attempts).where(attempts.c.message_id == "m1")
        ).scalar_one()
    assert counted == 1

    run_until_idle(FailsOnce(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m0": 1, "m1": 1, "m2": 1}
    assert broker.pending("orders") == 0 and "orders" not in broker.dead_letters


def test_a_message_that_recovers_on_its_retry_is_settled_with_its_batch(
    sqlite_engine: Engine,
) -> None:
    """Mutation caught: the retry loop (``Processor._retry``) not reporting the retry
    that committed: the message would be processed and never acked (its offset or its
    delivery held until the connection closes, then a redelivery)."""
    committed: list[str] = []

    class FailsOnce(OrderConsumer):
        retry_policy = FAST_RETRY

        def handle(self, message: Message, ctx: Context) -> Any:
            result = super().handle(message, ctx)
            if message.id == "m1" and "m1-failed" not in committed:
                committed.append("m1-failed")
                raise RuntimeError("m1 fails once")
            return result

        def after_commit(self, messages: Sequence[Message]) -> None:
            committed.extend(str(m.id) for m in messages)

    broker = InMemoryBroker()
    publish_orders(broker, 3)
    transport = broker.transport("orders")
    processor = Processor(FailsOnce(), session_factory(sqlite_engine), transport)
    report = processor.process(transport.fetch(10, 0.1))

    assert sorted(str(d.message.id) for d in report.processed) == ["m0", "m1", "m2"]
    assert settled(broker) == 3 and transport.in_flight == 0
    assert sorted(committed) == ["m0", "m1", "m1-failed", "m2"]  # after_commit saw m1
    assert order_counts(sqlite_engine) == {"m0": 1, "m1": 1, "m2": 1}


# -- dead lettering: a refused dead letter that cannot be parked ---------------------------


class RefusedDeadLetters(MemoryTransport):
    """A dead-letter target that refuses every record for good (too large, say)."""

    def dead_letter(self, delivery: Delivery[int], record: DeadLetter) -> None:
        raise DeadLetterRefusedError("record too large for the dead-letter queue")


def parked_rows(engine: Engine) -> int:
    with Session(engine) as session:
        return sum(DeadLetterTable().counts(session).values())


@pytest.mark.parametrize("failure", ["error", "outage-then-stop"])
def test_a_refused_dead_letter_that_cannot_be_parked_stays_unsettled(
    sqlite_engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failure: str,
) -> None:
    """Mutation caught: ``DeadLettering._park`` returning True when keeping the refused
    dead letter in the database failed (an error, or a stop while the database was
    down): the message would be acked with its dead letter stored nowhere."""
    broker = InMemoryBroker()
    broker.publish("orders", b"not json", message_id="bad")  # undecodable: a dead letter
    publish_orders(broker, 2)
    transport = RefusedDeadLetters(broker, "orders")
    processor = Processor(OrderConsumer(), session_factory(sqlite_engine), transport)

    def park_fails(*args: Any, **kwargs: Any) -> None:
        if failure == "error":
            raise RuntimeError("disk full")
        processor.stop.request()
        raise DisconnectionError("database went away")

    monkeypatch.setattr(DeadLetterTable, "park", park_fails)
    with caplog.at_level(logging.ERROR, logger="mqdedup.consumers.dead_lettering"):
        report = processor.process(transport.fetch(10, 0.1))

    assert [d.message.id for d in report.unsettled] == ["bad"]
    assert report.dead_lettered == []
    assert processor.metrics.dead_letters_parked == 0
    if failure == "error":  # the operator is told, with the message's coordinates
        (line,) = [r for r in caplog.records if "could not keep" in r.getMessage()]
        assert line.__dict__["consumer"] == "orders" and line.__dict__["coordinates"]
    assert settled(broker) == 2 and transport.in_flight == 1  # only m0, m1 were acked
    monkeypatch.undo()
    assert parked_rows(sqlite_engine) == 0

    # The database works again: the next try parks it, and only then is it settled.
    transport.give_back(report.unsettled)
    retried = Processor(OrderConsumer(), session_factory(sqlite_engine), transport)
    report = retried.process(transport.fetch(10, 0.1))
    assert [d.message.id for d, _ in report.dead_lettered] == ["bad"]
    assert parked_rows(sqlite_engine) == 1 and settled(broker) == 3


def test_a_refused_dead_letter_of_a_consumer_without_a_database_stays_unsettled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Mutation caught: ``DeadLettering._park`` returning True for a consumer whose
    claims live in Redis (no database to park in): its refused dead letter would be
    acked and stored nowhere."""
    broker = InMemoryBroker()
    broker.publish("orders", b"{}", message_id="bad")
    transport = RefusedDeadLetters(broker, "orders")
    metrics = Metrics()
    letters = DeadLettering(
        OrderConsumer(), transport, metrics, None, Outages(stop=StopToken(), is_transient=bool)
    )
    (delivery,) = transport.fetch(1, 0.1)
    report = BatchReport(
        dead_lettered=[(delivery, DeadLetter(reason="bad", consumer="orders", attempts=1))]
    )

    with caplog.at_level(logging.ERROR, logger="mqdedup.consumers.dead_lettering"):
        letters.send(report)

    assert report.dead_lettered == [] and report.unsettled == [delivery]
    (line,) = [r for r in caplog.records if "no database" in r.getMessage()]
    assert {k: line.__dict__.get(k) for k in ("consumer", "reason", "refusal")} == {
        "consumer": "orders",
        "reason": "bad",
        "refusal": "record too large for the dead-letter queue",
    }
    assert line.__dict__["coordinates"]
    assert (metrics.dead_letter_failures, metrics.dead_letters_parked) == (1, 0)
    assert report.settled == [] and transport.in_flight == 1


# -- the relay: a batch that did not publish completely ends the burst ----------------------


class FailsFirstTry(MemoryPublisher):
    """Publishes like the memory broker, except that the first batch holding the row
    ``target`` comes back refused (that row) or unavailable (the whole batch)."""

    def __init__(self, target: str, outcome: str) -> None:
        super().__init__()
        self.target = target
        self.outcome = outcome
        self.failed = threading.Event()

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        if self.failed.is_set() or self.target not in [r.message_id for r in records]:
            return super().publish_batch(records)
        self.failed.set()
        if self.outcome == "unavailable":
            return [PublishResult.unavailable("broker down")] * len(records)
        results: list[PublishResult] = []
        for record in records:
            if record.message_id == self.target:
                results.append(PublishResult.rejected("refused once"))
            else:
                results.extend(super().publish_batch([record]))
        return results


@pytest.mark.parametrize("outcome", ["refused", "unavailable"])
def test_a_keys_rows_stay_in_order_when_a_batch_did_not_publish_completely(
    sqlite_engine: Engine, outcome: str
) -> None:
    """Mutation caught: the relay's burst (``Relay._burst``) going on with the batch it
    claimed ahead although rows of the current batch were refused or unavailable: the
    key's later rows would overtake the row to retry."""
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session)
        ids = [writer.publish(f"{n}".encode(), topic="t", key="A") for n in range(6)]
    publisher = FailsFirstTry(ids[1], outcome)
    relay = Relay(
        sqlite_engine,
        {"kafka": publisher},
        config=RelayConfig(
            batch_size=2,  # [0, 1] publishing while [2, 3] is claimed ahead
            poll_interval=0.01,
            initial_backoff=0.0,  # the refused row is due again at once
            max_backoff=0.0,
            broker_backoff_max=0.05,
        ),
    )

    relay.drain(timeout=20)

    assert publisher.failed.is_set()
    published = publisher.published_ids()
    assert [i for i in published if i != ids[0]] == ids[1:], "key A's rows left in id order"
    assert published.count(ids[1]) == 1


def test_a_burst_that_reaches_its_maintenance_time_ends_after_its_batch(
    sqlite_engine: Engine,
) -> None:
    """Mutations caught: the burst going on without a batch claimed ahead (none is
    claimed once maintenance is due): the relay would crash in the middle of its burst;
    and the burst going on past its maintenance time (claiming ahead anyway, or no purge
    due): shards would move and rows be purged only when the outbox runs dry."""
    with Session(sqlite_engine) as session, session.begin():
        writer = OutboxWriter(session)
        ids = [writer.publish(f"{n}".encode(), topic="t", key="A") for n in range(5)]
    publisher = MemoryPublisher()
    relay = Relay(
        sqlite_engine,
        {"kafka": publisher},
        config=RelayConfig(batch_size=2, poll_interval=0.01, purge_interval=0.0),
    )

    purges: list[int] = []
    purge = relay.purge

    def counted_purge() -> int:
        purges.append(len(publisher.published))
        return purge()

    relay.purge = counted_purge  # type: ignore[method-assign]
    metrics = relay.run(until_idle=True)  # maintenance is due after every batch

    assert publisher.published_ids() == ids
    assert (metrics.published, metrics.batches) == (5, 3)
    assert purges[:4] == [0, 2, 4, 5], "maintenance ran between the batches"


# -- the relay's Kafka producer ------------------------------------------------------------


def built_producer(publisher: Any) -> Any:
    """The real ``KafkaProducer`` a Kafka publisher makes (the broker's version pinned:
    it is built without connecting), closed again."""
    built: list[Any] = []

    def real_producer(**config: Any) -> Any:
        built.append(kafka.KafkaProducer(**config, api_version=(4, 0)))
        return built[-1]

    publisher._producer.factory = real_producer
    try:
        assert publisher._producer.get() is built[0]
    finally:
        publisher.close()
    return built[0]


def test_the_relays_kafka_producer_is_idempotent_with_acks_all() -> None:
    """Mutation caught: the relay's Kafka publisher losing ``acks=all`` or idempotence.
    On a single broker nothing shows it (the leader is every replica), so the settings
    are checked where they take effect: on the real ``KafkaProducer`` the relay builds."""
    from mqdedup.cli.runners import create_publishers
    from mqdedup.kafka.publisher import KafkaPublisher

    publisher: Any = create_publishers(kafka_bootstrap="127.0.0.1:1")["kafka"]
    assert publisher.config["acks"] == "all"  # explicit: never left to the library's default
    assert publisher.config["enable_idempotence"] is True
    producer = built_producer(publisher)
    assert producer.config["acks"] == -1  # kafka-python's spelling of "all"
    assert producer.config["enable_idempotence"] is True

    # The bounds that make a broker that is down UNAVAILABLE within the publisher's
    # timeouts, never a hung relay: the defaults (flush 30 s, metadata 10 s, connect 5 s)
    # and others.
    cases: list[tuple[dict[str, Any], tuple[int, ...]]] = [
        ({}, (10_000, 5_000, 30_000, 60_000)),
        (
            {"flush_timeout": 5.0, "metadata_timeout": 2.0, "connect_timeout": 1.0},
            (2_000, 1_000, 5_000, 30_000),
        ),
    ]
    for timeouts, expected in cases:
        producer = built_producer(KafkaPublisher("127.0.0.1:1", **timeouts))
        assert producer.config["bootstrap_servers"] == ["127.0.0.1:1"]
        bounds = ("max_block_ms", "bootstrap_timeout_ms", "request_timeout_ms")
        assert tuple(producer.config[name] for name in (*bounds, "delivery_timeout_ms")) == (
            expected
        ), timeouts


# -- the relay's RabbitMQ publisher --------------------------------------------------------


def rabbitmq_records(count: int) -> list[OutboxRecord]:
    return [
        OutboxRecord(
            id=n,
            message_id=f"m{n}",
            broker="rabbitmq",
            destination="",
            routing_key="orders",
            key=None,
            headers={},
            properties=None,
            payload=b"{}",
            attempts=0,
            created_at=datetime.now(UTC),
        )
        for n in range(count)
    ]


def test_only_the_records_rabbitmq_confirmed_late_count_as_published_without_a_publish() -> None:
    """Mutation caught: ``RabbitMQPublisher.publish_batch`` taking the wrong records for
    late-confirmed ones (a confirm that came after its batch had ended, during an
    alarm): records the broker never took would be reported published, and their rows
    deleted."""
    from mqdedup.rabbitmq.publisher import RabbitMQPublisher

    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=0.1)
    # m1 was in flight when its batch ended (blocked); its confirm arrives afterwards, as
    # pika delivers it: through the confirm callback of the channel.
    publisher._orphans[7] = "m1"
    publisher._late_confirms(7, False, True)
    try:
        results = publisher.publish_batch(rabbitmq_records(3))  # the broker is unreachable
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [
        PublishOutcome.UNAVAILABLE,
        PublishOutcome.PUBLISHED,
        PublishOutcome.UNAVAILABLE,
    ]


def test_rows_published_during_a_rabbitmq_resource_alarm_are_unavailable_not_refused() -> None:
    """Mutation caught: ``RabbitMQPublisher.publish_batch`` reporting the records of a
    blocked connection (a memory or disk alarm) as refused: the relay would count
    attempts against them and mark them ``failed`` during a long alarm, instead of
    pausing the broker (promise 6). The alarm is announced as pika announces it, through
    the ``Connection.Blocked`` callback."""
    from mqdedup.rabbitmq.publisher import RabbitMQPublisher

    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=0.1)
    records = rabbitmq_records(3)
    publisher._on_blocked(None, None)
    try:
        results = publisher.publish_batch(records)
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [PublishOutcome.UNAVAILABLE] * 3
    assert all("resource alarm" in (r.error or "") for r in results)
