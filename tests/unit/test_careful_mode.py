"""Careful mode: deliveries that come back run one at a time, their attempt counted first.

In-memory broker + SQLite. A handler that kills its process is simulated with
``SimulatedCrash`` (a BaseException nothing in mqdedup catches); the supervisor's
restarts with :func:`run_until_idle_restarting`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from sqlalchemy import Engine, event, select

from mqdedup import InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import Context
from mqdedup.consumers.memory import MemoryTransport, run_until_idle_restarting
from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import schema
from mqdedup.errors import BrokerUnavailableError, SimulatedCrash
from tests.support import BulkOrderConsumer, OrderConsumer, order_counts

MAX_ATTEMPTS = 3
FAST_RETRY = RetryPolicy(max_attempts=MAX_ATTEMPTS, initial_backoff=0.001, max_backoff=0.01)


def publish_orders(broker: InMemoryBroker, count: int, queue: str = "orders") -> None:
    for number in range(count):
        broker.publish(
            queue, json.dumps({"order": number, "amount": number}), message_id=f"m{number}"
        )


def attempts_rows(engine: Engine) -> dict[str, tuple[int, str | None]]:
    table = schema().attempts
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, table.c.attempts, table.c.last_error)
        ).all()
    return {row.message_id: (row.attempts, row.last_error) for row in rows}


@pytest.fixture
def statements(sqlite_engine: Engine) -> Iterator[list[str]]:
    """Every SQL statement the engine runs while the test body runs."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(sqlite_engine, "before_cursor_execute", record)
    yield seen
    event.remove(sqlite_engine, "before_cursor_execute", record)


def make_killer(base: type[OrderConsumer], isolation: str, killer: str = "m10") -> Any:
    class Killer(base):  # type: ignore[valid-type,misc]
        batch_size = 50
        retry_policy = FAST_RETRY
        failure_isolation = isolation
        runs: ClassVar[Counter[str]] = Counter()

        def handle(self, message: Message, ctx: Context) -> Any:
            Killer.runs[str(message.id)] += 1
            if message.id == killer:
                raise SimulatedCrash("the handler killed its process")
            return super().handle(message, ctx)

        def handle_batch(self, messages: Any, ctx: Any) -> dict[str, Any]:
            results: dict[str, Any] = {}
            for message in messages:
                results[str(message.id)] = self.handle(message, ctx)
            return results

    if base is OrderConsumer:
        del Killer.handle_batch  # a per-message consumer
    return Killer


@pytest.mark.parametrize(
    ("base", "isolation"),
    [
        (OrderConsumer, "auto"),
        (OrderConsumer, "transaction"),
        (BulkOrderConsumer, "auto"),
    ],
)
def test_a_message_that_kills_its_worker_is_dead_lettered_alone(
    sqlite_engine: Engine, base: type[OrderConsumer], isolation: str
) -> None:
    consumer_class = make_killer(base, isolation)
    broker = InMemoryBroker()
    publish_orders(broker, 200)

    run = run_until_idle_restarting(consumer_class(), broker, "orders", sqlite_engine)

    # The first death happens in an ordinary batch, before anything could record it;
    # every later run of the killer was counted and committed before it started.
    assert run.crashes == MAX_ATTEMPTS + 1
    assert consumer_class.runs["m10"] == run.crashes
    dead = broker.dead_letters["orders"]
    assert [d.message.header("message-id") for d in dead] == ["m10"]
    assert dead[0].record.reason == WORKER_DIED
    assert dead[0].record.attempts == MAX_ATTEMPTS
    assert attempts_rows(sqlite_engine)["m10"] == (MAX_ATTEMPTS, WORKER_DIED)
    counts = order_counts(sqlite_engine)
    assert len(counts) == 199 and "m10" not in counts and set(counts.values()) == {1}
    assert broker.pending("orders") == 0 and broker.settled_count["orders"] >= 200


def test_without_careful_mode_the_killer_loops(
    sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario above is a crash loop when redeliveries are not handled carefully."""
    from mqdedup.consumers import memory

    original = memory.InMemoryBroker._return

    def returns_unflagged(self: InMemoryBroker, queue: str, messages: Any) -> None:
        original(self, queue, messages)
        with self._lock:
            waiting = self._queues[queue]
            for index, message in enumerate(waiting):
                object.__setattr__(message, "redelivered", False)
                waiting[index] = message

    monkeypatch.setattr(memory.InMemoryBroker, "_return", returns_unflagged)
    broker = InMemoryBroker()
    publish_orders(broker, 200)
    with pytest.raises(RuntimeError, match="crash loop"):
        run_until_idle_restarting(
            make_killer(OrderConsumer, "auto")(), broker, "orders", sqlite_engine, max_restarts=8
        )


class RefusingDeadLetters(MemoryTransport):
    """A transport whose dead-letter target is unreachable (every publish fails)."""

    def dead_letter(self, delivery: Delivery[int], record: DeadLetter) -> None:
        raise BrokerUnavailableError("dead-letter queue unreachable")


def test_a_dead_letter_that_keeps_failing_never_reruns_the_handler_past_max_attempts(
    sqlite_engine: Engine,
) -> None:
    calls: Counter[str] = Counter()

    class Poisoned(OrderConsumer):
        retry_policy = FAST_RETRY
        fail_ids = frozenset({"m5"})

        def handle(self, message: Message, ctx: Context) -> Any:
            calls[str(message.id)] += 1
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish_orders(broker, 20)
    for _ in range(5):  # five worker lives with the dead-letter target down
        Worker(Poisoned(), RefusingDeadLetters(broker, "orders"), sqlite_engine).run(
            until_idle=True
        )
        assert broker.pending("orders") == 1  # m5 came back, unsettled
    assert calls["m5"] == MAX_ATTEMPTS
    assert attempts_rows(sqlite_engine)["m5"][0] == MAX_ATTEMPTS

    # The target is back: m5 is dead-lettered with its real last error, without a run.
    run_until_idle(Poisoned(), broker.transport("orders"), sqlite_engine)
    assert calls["m5"] == MAX_ATTEMPTS
    dead = broker.dead_letters["orders"]
    assert [d.message.header("message-id") for d in dead] == ["m5"]
    assert dead[0].record.reason == (
        f"handler failed after {MAX_ATTEMPTS} attempts: RuntimeError: cannot handle m5"
    )
    assert dead[0].record.attempts == MAX_ATTEMPTS
    counts = order_counts(sqlite_engine)
    assert len(counts) == 19 and set(counts.values()) == {1}
    assert broker.pending("orders") == 0


def test_a_failing_redelivered_message_counts_each_attempt_once(sqlite_engine: Engine) -> None:
    calls: Counter[str] = Counter()

    class Failing(OrderConsumer):
        retry_policy = FAST_RETRY
        fail_ids = frozenset({"m0"})

        def handle(self, message: Message, ctx: Context) -> Any:
            calls[str(message.id)] += 1
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    publish_orders(broker, 3)
    first = broker.transport("orders")
    assert len(first.fetch(10, 0.1)) == 3
    first.crash()  # handed out, never handled: all three come back redelivered

    metrics = run_until_idle(Failing(), broker.transport("orders"), sqlite_engine)

    assert calls == Counter({"m0": MAX_ATTEMPTS, "m1": 1, "m2": 1})
    assert attempts_rows(sqlite_engine)["m0"] == (
        MAX_ATTEMPTS,
        "RuntimeError: cannot handle m0",
    )
    dead = broker.dead_letters["orders"]
    assert dead[0].record.attempts == MAX_ATTEMPTS
    assert dead[0].record.error_class == "builtins.RuntimeError"
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (2, 1, 2)
    assert sorted(order_counts(sqlite_engine)) == ["m1", "m2"]


def test_redelivered_duplicates_are_settled_with_one_read_and_record_nothing(
    sqlite_engine: Engine, statements: list[str]
) -> None:
    class CrashBeforeSettle(OrderConsumer):
        crashed = False

        def after_commit(self, messages: Any) -> None:
            if not CrashBeforeSettle.crashed:
                CrashBeforeSettle.crashed = True
                raise SimulatedCrash("after commit, before the ack")

    broker = InMemoryBroker()
    publish_orders(broker, 100)
    with pytest.raises(SimulatedCrash):
        Worker(CrashBeforeSettle(), broker.transport("orders"), sqlite_engine).run(until_idle=True)
    statements.clear()

    metrics = run_until_idle(CrashBeforeSettle(), broker.transport("orders"), sqlite_engine)

    assert (metrics.duplicates, metrics.processed) == (100, 0)
    sql = [s for s in statements if not s.upper().startswith("BEGIN")]
    assert len(sql) == 1 and sql[0].lstrip().upper().startswith("SELECT")
    assert attempts_rows(sqlite_engine) == {}
    assert set(order_counts(sqlite_engine).values()) == {1}


def test_first_deliveries_take_the_ordinary_path(
    sqlite_engine: Engine, statements: list[str]
) -> None:
    """No read and no attempt counting for messages that were never delivered before."""

    class Orders(OrderConsumer):
        retry_policy = FAST_RETRY

    broker = InMemoryBroker()
    publish_orders(broker, 100)
    run_until_idle(Orders(), broker.transport("orders"), sqlite_engine)
    assert not [s for s in statements if "message_attempts" in s]
    assert not [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(order_counts(sqlite_engine)) == 100
