"""The processing core on SQLite and the in-memory broker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.consumers.memory import MemoryTransport
from mqdedup.consumers.transport import Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.db.engine import session_factory
from mqdedup.db.schema import schema
from mqdedup.dedup import ids as id_strategies
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError, SimulatedCrash
from tests.support import BulkOrderConsumer, OrderConsumer, order_counts

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.01)


def publish_orders(broker: InMemoryBroker, count: int, queue: str = "orders") -> None:
    for number in range(count):
        broker.publish(
            queue, json.dumps({"order": number, "amount": number}), message_id=f"m{number}"
        )


class FastOrders(OrderConsumer):
    retry_policy = FAST_RETRY


def attempts_row(engine: Engine, message_id: str) -> int | None:
    table = schema().attempts
    with engine.connect() as connection:
        return connection.execute(
            select(table.c.attempts).where(table.c.message_id == message_id)
        ).scalar_one_or_none()


def is_claimed(engine: Engine, consumer: str, message_id: str) -> bool:
    with engine.connect() as connection:
        from sqlalchemy.orm import Session

        with Session(bind=connection) as session:
            return DedupStore().is_processed(session, consumer, message_id)


@pytest.mark.parametrize("consumer_class", [FastOrders, BulkOrderConsumer])
def test_duplicates_are_skipped_and_each_order_written_once(
    sqlite_engine: Engine, consumer_class: type[OrderConsumer]
) -> None:
    broker = InMemoryBroker(seed=3)
    publish_orders(broker, 1000)
    copies = broker.inject_duplicates("orders", 0.3)
    assert copies > 200

    metrics = run_until_idle(consumer_class(), broker.transport("orders"), sqlite_engine)

    counts = order_counts(sqlite_engine)
    assert len(counts) == 1000 and set(counts.values()) == {1}
    assert metrics.processed == 1000
    assert metrics.duplicates == copies
    assert broker.pending("orders") == 0 and broker.settled_count["orders"] == 1000 + copies


def test_repeats_inside_one_batch_are_duplicates(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    for _ in range(5):
        broker.publish("orders", b'{"order": 1}', message_id="same")
    metrics = run_until_idle(FastOrders(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"same": 1}
    assert (metrics.processed, metrics.duplicates) == (1, 4)


@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_failing_handler_does_not_fail_its_batch_mates(
    sqlite_engine: Engine, isolation: str
) -> None:
    class Failing(FastOrders):
        fail_ids = frozenset({"m42"})
        failure_isolation = isolation  # type: ignore[assignment]

    broker = InMemoryBroker()
    publish_orders(broker, 100)
    metrics = run_until_idle(Failing(), broker.transport("orders"), sqlite_engine)

    counts = order_counts(sqlite_engine)
    assert len(counts) == 99 and "m42" not in counts and set(counts.values()) == {1}
    dead = broker.dead_letters["orders"]
    assert len(dead) == 1
    assert dead[0].message.header("message-id") == "m42"
    assert dead[0].record.attempts == 3
    assert dead[0].record.error_class == "builtins.RuntimeError"
    assert "cannot handle m42" in dead[0].record.reason
    assert not is_claimed(sqlite_engine, "orders", "m42")  # no claim left behind
    assert is_claimed(sqlite_engine, "orders", "m41")
    assert attempts_row(sqlite_engine, "m42") == 3
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (99, 1, 2)


def test_a_handler_that_recovers_on_retry_is_processed_once(sqlite_engine: Engine) -> None:
    calls: list[str] = []

    class Flaky(FastOrders):
        def handle(self, message: Message, ctx: Context) -> Any:
            calls.append(str(message.id))
            result = super().handle(message, ctx)
            if message.id == "m3" and calls.count("m3") < 2:
                raise ConnectionError("downstream hiccup")
            return result

    broker = InMemoryBroker()
    publish_orders(broker, 10)
    metrics = run_until_idle(Flaky(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine)["m3"] == 1
    assert calls.count("m3") == 2 and metrics.retries == 1 and metrics.dead_lettered == 0


def test_attempts_are_counted_across_redeliveries(sqlite_engine: Engine) -> None:
    """A worker that dies between attempts does not reset the message's attempt count."""

    class AlwaysFails(FastOrders):
        fail_ids = frozenset({"m0"})
        retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.001)

    store = DedupStore(sessions=session_factory(sqlite_engine))
    store.record_failure("orders", "m0", "earlier life")
    store.record_failure("orders", "m0", "earlier life")
    broker = InMemoryBroker()
    publish_orders(broker, 1)
    metrics = run_until_idle(AlwaysFails(), broker.transport("orders"), sqlite_engine)
    assert metrics.dead_lettered == 1 and metrics.retries == 0
    assert broker.dead_letters["orders"][0].record.attempts == 3


def test_missing_id_and_undecodable_body_are_dead_lettered_and_counts_add_up(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    publish_orders(broker, 20)
    broker.publish("orders", b'{"order": "no-id"}')
    broker.publish("orders", b"\x00not json", message_id="bad-body")
    metrics = run_until_idle(FastOrders(), broker.transport("orders"), sqlite_engine)

    reasons = sorted(d.record.reason for d in broker.dead_letters["orders"])
    assert reasons[0] == "missing message id: no 'message-id' header"
    assert reasons[1].startswith("undecodable body: invalid JSON")
    assert metrics.delivered == 22 == metrics.processed + metrics.duplicates + metrics.dead_lettered
    # A malformed body is a property of the message: no retries for it.
    assert metrics.retries == 0
    assert len(order_counts(sqlite_engine)) == 20
    assert broker.dead_letters["orders"][1].message.body == b"\x00not json"


def test_crash_after_commit_before_settle_has_no_second_effect(sqlite_engine: Engine) -> None:
    class CrashOnce(FastOrders):
        crashed = False

        def after_commit(self, messages: Sequence[Message]) -> None:
            if not CrashOnce.crashed:
                CrashOnce.crashed = True
                raise SimulatedCrash("after commit, before ack")

    broker = InMemoryBroker()
    publish_orders(broker, 250)
    transport = broker.transport("orders")
    with pytest.raises(SimulatedCrash):
        Worker(CrashOnce(), transport, sqlite_engine).run(until_idle=True)
    # The first batch committed but was never settled: the broker has it again.
    assert broker.pending("orders") == 250
    metrics = run_until_idle(CrashOnce(), broker.transport("orders"), sqlite_engine)
    counts = order_counts(sqlite_engine)
    assert len(counts) == 250 and set(counts.values()) == {1}
    assert metrics.duplicates == CrashOnce.batch_size


def test_duplicates_get_the_first_delivery_s_stored_result(sqlite_engine: Engine) -> None:
    seen: list[tuple[str | None, Any]] = []

    class Replying(FastOrders):
        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            seen.append((message.id, stored_result))

    broker = InMemoryBroker()
    broker.publish("orders", b'{"order": 7}', message_id="a")
    run_until_idle(Replying(), broker.transport("orders"), sqlite_engine)
    broker.publish("orders", b'{"order": 7}', message_id="a")
    run_until_idle(Replying(), broker.transport("orders"), sqlite_engine)
    assert seen == [("a", {"order": 7, "status": "accepted"})]


def test_a_result_that_is_not_json_fails_the_message(sqlite_engine: Engine) -> None:
    class BadResult(FastOrders):
        def handle(self, message: Message, ctx: Context) -> Any:
            return object()

    broker = InMemoryBroker()
    broker.publish("orders", b"{}", message_id="a")
    run_until_idle(BadResult(), broker.transport("orders"), sqlite_engine)
    assert "not JSON-serialisable" in broker.dead_letters["orders"][0].record.reason


def test_failing_bulk_handler_falls_back_to_single_messages(sqlite_engine: Engine) -> None:
    class Bulk(BulkOrderConsumer):
        retry_policy = FAST_RETRY
        fail_ids = frozenset({"m5"})

    broker = InMemoryBroker()
    publish_orders(broker, 30)
    metrics = run_until_idle(Bulk(), broker.transport("orders"), sqlite_engine)
    counts = order_counts(sqlite_engine)
    assert len(counts) == 29 and "m5" not in counts and set(counts.values()) == {1}
    assert metrics.dead_lettered == 1


def test_without_dedup_duplicates_are_processed_again(sqlite_engine: Engine) -> None:
    """The control experiment: the same run with dedup switched off doubles effects."""

    class NoDedup(FastOrders):
        deduplicate = False

    broker = InMemoryBroker(seed=1)
    publish_orders(broker, 200)
    broker.inject_duplicates("orders", 0.3)
    run_until_idle(NoDedup(), broker.transport("orders"), sqlite_engine)
    assert max(order_counts(sqlite_engine).values()) > 1


def test_invalid_consumer_settings_are_refused() -> None:
    class Nothing(OrderConsumer):
        batch_size = 0

    with pytest.raises(ConfigurationError, match="batch_size"):
        Nothing().validate()
    with pytest.raises(ConfigurationError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_purge_removes_old_claims_in_chunks(sqlite_engine: Engine) -> None:
    from datetime import timedelta

    broker = InMemoryBroker()
    publish_orders(broker, 120)
    run_until_idle(FastOrders(), broker.transport("orders"), sqlite_engine)
    store = DedupStore()
    assert store.purge(sqlite_engine, timedelta(days=1)) == 0
    assert store.purge(sqlite_engine, timedelta(seconds=-1), chunk_size=50) == 120
    with sqlite_engine.connect() as connection:
        assert (
            connection.execute(select(func.count()).select_from(schema().processed)).scalar() == 0
        )


def test_purge_advances_the_retention_horizon(sqlite_engine: Engine) -> None:
    from datetime import timedelta

    store = DedupStore()
    assert store.retention_horizon(sqlite_engine, "orders") is None
    store.purge(sqlite_engine, timedelta(days=7), consumer="orders")
    first = store.retention_horizon(sqlite_engine, "orders")
    assert first is not None and store.retention_horizon(sqlite_engine, "other") is None
    store.purge(sqlite_engine, timedelta(days=30))  # every consumer, an older cutoff
    assert store.retention_horizon(sqlite_engine, "orders") == first
    assert store.retention_horizon(sqlite_engine, "other") is not None
    store.purge(sqlite_engine, timedelta(days=1), consumer="orders")
    later = store.retention_horizon(sqlite_engine, "orders")
    assert later is not None and later > first


# -- failure_isolation = "transaction": one transaction per message, one settle per batch --


class PerMessageTx(FastOrders):
    failure_isolation = "transaction"
    commits: list[list[str]]

    def __init__(self) -> None:
        self.commits = []

    def after_commit(self, messages: Sequence[Message]) -> None:
        self.commits.append([str(m.id) for m in messages])


class SettleSpy(MemoryTransport):
    """Records each settle call and what the database held at that moment."""

    def __init__(self, broker: InMemoryBroker, queue: str, engine: Engine) -> None:
        super().__init__(broker, queue)
        self.engine = engine
        self.calls: list[tuple[list[str], dict[str, int]]] = []

    def settle(self, deliveries: Sequence[Delivery[int]]) -> None:
        ids = [str(d.message.header("message-id")) for d in deliveries]
        self.calls.append((ids, order_counts(self.engine)))
        super().settle(deliveries)


def test_transaction_mode_commits_each_message_alone_and_settles_once_per_batch(
    sqlite_engine: Engine,
) -> None:
    class Failing(PerMessageTx):
        fail_ids = frozenset({"m42", "m130"})

    broker = InMemoryBroker()
    publish_orders(broker, 250)
    transport = SettleSpy(broker, "orders", sqlite_engine)
    consumer = Failing()
    metrics = Worker(consumer, transport, sqlite_engine).run(until_idle=True)

    counts = order_counts(sqlite_engine)
    assert len(counts) == 248 and set(counts.values()) == {1}
    assert "m42" not in counts and "m130" not in counts
    # Every message committed in its own transaction (one after_commit per message).
    assert all(len(batch) == 1 for batch in consumer.commits)
    assert len(consumer.commits) == 248
    # One settle per batch of 100, each after every commit of its batch, including the
    # failing message's retries (then dead-lettered alone).
    assert [len(ids) for ids, _ in transport.calls] == [100, 100, 50]
    for ids, committed in transport.calls:
        assert all(i in committed for i in ids if i not in ("m42", "m130"))
    assert sorted(d.message.header("message-id") or "" for d in broker.dead_letters["orders"]) == [
        "m130",
        "m42",
    ]
    assert not is_claimed(sqlite_engine, "orders", "m42")
    assert attempts_row(sqlite_engine, "m42") == 3
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (248, 2, 4)
    assert broker.pending("orders") == 0 and broker.settled_count["orders"] == 250


def test_transaction_mode_a_message_that_recovers_on_retry_commits_once(
    sqlite_engine: Engine,
) -> None:
    calls: list[str] = []

    class Flaky(PerMessageTx):
        def handle(self, message: Message, ctx: Context) -> Any:
            calls.append(str(message.id))
            result = super().handle(message, ctx)
            if message.id == "m3" and calls.count("m3") < 2:
                raise ConnectionError("downstream hiccup")
            return result

    broker = InMemoryBroker()
    publish_orders(broker, 10)
    metrics = run_until_idle(Flaky(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine)["m3"] == 1 and len(order_counts(sqlite_engine)) == 10
    # No batch-mate's handler ran twice: only m3 was called again.
    assert sorted(calls) == sorted([f"m{n}" for n in range(10)] + ["m3"])
    assert metrics.retries == 1 and metrics.dead_lettered == 0


def test_transaction_mode_crash_mid_batch_redelivers_committed_ones_as_duplicates(
    sqlite_engine: Engine,
) -> None:
    class CrashAt60(PerMessageTx):
        crashed = False

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "m60" and not CrashAt60.crashed:
                CrashAt60.crashed = True
                raise SimulatedCrash("process dies in the middle of the batch")
            return super().handle(message, ctx)

    broker = InMemoryBroker(seed=5)
    publish_orders(broker, 100)
    broker.inject_duplicates("orders", 0.2)
    with pytest.raises(SimulatedCrash):
        Worker(CrashAt60(), broker.transport("orders"), sqlite_engine).run(until_idle=True)
    # m0..m59 committed one by one; nothing was settled, so the broker has them all again.
    assert len(order_counts(sqlite_engine)) == 60
    assert broker.settled_count.get("orders", 0) == 0

    metrics = run_until_idle(CrashAt60(), broker.transport("orders"), sqlite_engine)
    counts = order_counts(sqlite_engine)
    assert len(counts) == 100 and set(counts.values()) == {1}
    assert metrics.processed == 40
    assert metrics.duplicates == metrics.delivered - 40 >= 60
    assert broker.pending("orders") == 0


def test_transaction_mode_stop_leaves_the_rest_of_the_batch_unsettled(
    sqlite_engine: Engine,
) -> None:
    class StopAt10(PerMessageTx):
        def after_commit(self, messages: Sequence[Message]) -> None:
            super().after_commit(messages)
            if len(self.commits) == 10:
                worker.stop.request()

    broker = InMemoryBroker()
    publish_orders(broker, 100)
    transport = SettleSpy(broker, "orders", sqlite_engine)
    worker = Worker(StopAt10(), transport, sqlite_engine)
    worker.run()
    # The ten committed messages were settled; the other 90 went back to the broker.
    assert [len(ids) for ids, _ in transport.calls] == [10]
    assert broker.pending("orders") == 90 and len(order_counts(sqlite_engine)) == 10
    metrics = run_until_idle(PerMessageTx(), broker.transport("orders"), sqlite_engine)
    assert metrics.processed == 90 and metrics.duplicates == 0
    assert set(order_counts(sqlite_engine).values()) == {1}


def test_transaction_mode_with_a_batch_handler_gets_one_message_at_a_time(
    sqlite_engine: Engine,
) -> None:
    sizes: list[int] = []

    class Bulk(BulkOrderConsumer):
        failure_isolation = "transaction"
        retry_policy = FAST_RETRY
        fail_ids = frozenset({"m5"})
        handle = Consumer.handle  # only the batch handler

        def handle_batch(self, messages: Sequence[Message], ctx: Any) -> dict[str, Any]:
            sizes.append(len(messages))
            return super().handle_batch(messages, ctx)

    broker = InMemoryBroker()
    publish_orders(broker, 30)
    metrics = run_until_idle(Bulk(), broker.transport("orders"), sqlite_engine)
    counts = order_counts(sqlite_engine)
    assert len(counts) == 29 and "m5" not in counts and set(counts.values()) == {1}
    assert set(sizes) == {1} and len(sizes) == 30 + 2  # m5: first run and two retries
    assert metrics.dead_lettered == 1


def test_unknown_failure_isolation_is_refused_with_the_choices() -> None:
    class Wrong(OrderConsumer):
        failure_isolation = "per-message"  # type: ignore[assignment]

    with pytest.raises(ConfigurationError, match="'transaction', not 'per-message'"):
        Wrong().validate()


def test_transaction_mode_outage_then_stop_settles_only_what_committed(
    sqlite_engine: Engine,
) -> None:
    from sqlalchemy.exc import DisconnectionError

    class Outage(PerMessageTx):
        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "m50":
                worker.stop.request()
                raise DisconnectionError("database went away")  # transient: never dead-lettered
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish_orders(broker, 100)
    worker = Worker(Outage(), broker.transport("orders"), sqlite_engine)
    worker.run()
    assert broker.settled_count["orders"] == 50 and broker.pending("orders") == 50
    assert len(order_counts(sqlite_engine)) == 50 and not broker.dead_letters
    assert worker.metrics.database_retries >= 2
    metrics = run_until_idle(PerMessageTx(), broker.transport("orders"), sqlite_engine)
    assert (metrics.processed, metrics.duplicates) == (50, 0)
    assert len(order_counts(sqlite_engine)) == 100


def test_ids_are_checked_once_but_always_whatever_the_strategy(sqlite_engine: Engine) -> None:
    """mqdedup's own strategies check the ids they return, so the processor does not
    check them again; an id from anything else is still checked: a NUL byte or an id
    too long for the key column is dead-lettered, never claimed."""

    def user_strategy(message: Message) -> str:
        return message.json()["id"]  # not checked by itself

    class FirstOfUsers(FastOrders):
        message_id_strategy = id_strategies.first_of(user_strategy, id_strategies.from_header())

    class OverriddenMessageId(FastOrders):
        def message_id(self, message: Message) -> str:
            return message.json()["id"]

    assert id_strategies.returns_checked_ids(FastOrders.message_id_strategy)
    assert id_strategies.returns_checked_ids(
        id_strategies.first_of(id_strategies.from_header(), id_strategies.from_content_hash)
    )
    assert id_strategies.returns_checked_ids(id_strategies.from_callable(user_strategy))
    assert not id_strategies.returns_checked_ids(FirstOfUsers.message_id_strategy)
    assert not id_strategies.returns_checked_ids(user_strategy)

    for index, consumer in enumerate((FirstOfUsers(), OverriddenMessageId())):
        broker = InMemoryBroker()
        for body in (
            {"id": f"good-{index}", "order": "o-1", "amount": 1},
            {"id": "nul\x00byte", "order": "o-2", "amount": 2},
            {"id": "x" * 256, "order": "o-3", "amount": 3},
        ):
            broker.publish("orders", json.dumps(body).encode())
        metrics = run_until_idle(consumer, broker.transport("orders"), sqlite_engine)

        reasons = sorted(d.record.reason for d in broker.dead_letters["orders"])
        assert reasons == [
            "message id contains a NUL byte (the consumer's message id)",
            "message id is longer than 255 characters (256, the consumer's message id)",
        ]
        assert (metrics.processed, metrics.dead_lettered) == (1, 2)


def test_claims_refuse_a_truth_test_so_old_set_style_callers_fail_loudly(
    sqlite_engine: Engine,
) -> None:
    """``DedupStore.claim`` returns ``Claims`` now (it used to return the new ids)."""
    store = DedupStore(sessions=session_factory(sqlite_engine))
    with session_factory(sqlite_engine)() as session, session.begin():
        claims = store.claim(session, "orders", ["a"])
        assert claims.new == {"a"}
        with pytest.raises(TypeError, match=r"Claims\.new"):
            bool(claims)
        assert store.claim(session, "orders", ["a"]).new == set()
