"""Consumers with ``dedup = RedisDedup(...)`` against a real Redis: duplicates, a killed
worker, failures, outages — through the same Worker and Processor as every consumer."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from mqdedup import (
    Consumer,
    Context,
    InMemoryBroker,
    Message,
    NoTransactionError,
    RedisDedup,
    RetryPolicy,
    Worker,
)
from mqdedup.cli.health import snapshot_ready
from mqdedup.consumers.memory import MemoryTransport, run_until_idle_restarting
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import WORKER_DIED
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.dedup.redis_claims import RedisClaimStore
from mqdedup.dedup.redis_client import RedisUnavailableError
from mqdedup.errors import DeadLetterRefusedError, SimulatedCrash
from mqdedup.stopping import StopToken
from tests.services import REPO, PrivateService, free_port, require_service, wait_for

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(
    max_attempts=3, initial_backoff=0.01, max_backoff=0.05, infrastructure_backoff_max=0.5
)


def sms_consumer(
    namespace: str, url: str | None = None, lease: float = 60.0, **attributes: Any
) -> type[Consumer]:
    """A consumer whose effect is an entry in the Redis list ``<namespace>effects``;
    its claims live in Redis at ``url`` (default ``MQDEDUP_REDIS_URL``)."""

    class Sms(Consumer):
        name = "sms"
        batch_size = 200
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        fail_ids: frozenset[str] = frozenset()
        flaky_ids: frozenset[str] = frozenset()
        effects: redis.Redis

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id in self.fail_ids:
                raise RuntimeError(f"provider refused {message.id}")
            if message.id in self.flaky_ids and self.effects.incr(f"{namespace}tries") == 1:
                raise ConnectionResetError("provider hung up")
            self.effects.rpush(f"{namespace}effects", str(message.id))
            return {"sent": message.id}

    Sms.dedup = RedisDedup(url=url, namespace=namespace, lease=lease)
    for key, value in attributes.items():
        setattr(Sms, key, value)
    return Sms


def effects(client: redis.Redis, namespace: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"{namespace}effects", 0, -1)]


def test_4k_deliveries_with_30pct_duplicates_two_workers(
    redis_conn: redis.Redis, namespace: str
) -> None:
    """Two workers share one queue: every unique message's effect happens exactly once."""
    consumer = sms_consumer(namespace, effects=redis_conn)
    broker = InMemoryBroker(seed=5)
    for number in range(4_000):
        broker.publish("sms", f"text {number}", message_id=f"sms-{number}")
    copies = broker.inject_duplicates("sms", 0.3)
    assert 1_000 < copies < 1_400

    workers = [Worker(consumer(), broker.transport("sms"), None) for _ in range(2)]
    threads = [threading.Thread(target=w.run, kwargs={"until_idle": True}) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)

    done = effects(redis_conn, namespace)
    assert len(done) == 4_000 and len(set(done)) == 4_000
    processed = sum(w.metrics.processed for w in workers)
    duplicates = sum(w.metrics.duplicates for w in workers)
    assert (processed, duplicates) == (4_000, copies)
    assert broker.settled_count["sms"] == 4_000 + copies
    assert all(w.metrics.processed > 0 for w in workers)  # both really worked


def test_worker_killed_while_holding_claims_is_recovered_after_the_lease(
    redis_url: str, redis_conn: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    """kill -9 a worker inside a handler: its claims block the redelivered messages
    until their lease runs out; then they are processed once. Completed ones stay done."""
    lease = 3.0
    holder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.tools.redis_claim_holder",
            redis_url,
            namespace,
            str(lease),
            str(tmp_path),
        ],
        cwd=REPO,
    )
    try:
        wait_for((tmp_path / "entered").exists, 30, "the holder to enter the sms-1 handler")
    finally:
        holder.kill()  # SIGKILL: no finally blocks, no cleanup in the worker
        holder.wait(timeout=30)
    assert holder.returncode == -9
    killed_at = time.monotonic()

    store = RedisClaimStore(redis_conn, namespace=namespace, lease=lease)
    held = {i: redis_conn.get(store.key("sms", i)) for i in ("sms-0", "sms-1", "sms-2")}
    assert held["sms-0"] == b'D|{"sent": "sms-0"}'  # completed before the kill
    assert held["sms-1"] is not None and held["sms-1"].startswith(b"P|")
    assert held["sms-2"] == held["sms-1"]  # claimed in the same batch, never started
    lease_left = redis_conn.pttl(store.key("sms", "sms-1")) / 1000
    assert 0 < lease_left <= lease
    assert effects(redis_conn, namespace) == ["sms-0"]

    # The broker redelivers the unsettled batch to a new worker.
    broker = InMemoryBroker()
    for number in range(3):
        broker.publish("sms", f"hello {number}", message_id=f"sms-{number}")
    consumer = sms_consumer(namespace, effects=redis_conn, lease=lease)
    worker = Worker(consumer(), broker.transport("sms"), None)
    metrics = worker.run(until_idle=True)
    waited = time.monotonic() - killed_at

    assert waited >= lease_left - 0.1  # nothing was processed before the lease ran out
    assert sorted(effects(redis_conn, namespace)) == ["sms-0", "sms-1", "sms-2"]
    assert (metrics.processed, metrics.duplicates) == (2, 1)
    for message_id in ("sms-1", "sms-2"):
        assert store.result("sms", message_id) == {"sent": message_id}


def test_failures_release_the_claim_retry_and_dead_letter(
    redis_conn: redis.Redis, namespace: str
) -> None:
    consumer = sms_consumer(
        namespace,
        effects=redis_conn,
        fail_ids=frozenset({"sms-13"}),
        flaky_ids=frozenset({"sms-7"}),
    )
    broker = InMemoryBroker()
    for number in range(20):
        broker.publish("sms", f"text {number}", message_id=f"sms-{number}")
    store = RedisClaimStore(redis_conn, namespace=namespace)
    metrics = Worker(consumer(), broker.transport("sms"), None).run(until_idle=True)

    done = effects(redis_conn, namespace)
    assert sorted(done) == sorted(f"sms-{n}" for n in range(20) if n != 13)
    assert len(done) == 19  # sms-7 failed once, then its retry succeeded once
    [dead] = broker.dead_letters["sms"]
    assert dead.message.properties["message_id"] == "sms-13" and dead.record.attempts == 3
    assert "RuntimeError: provider refused sms-13" in dead.record.reason
    assert redis_conn.get(store.key("sms", "sms-13")) is None  # no claim left behind
    assert store.attempts("sms", "sms-13")[0] == 3
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (19, 1, 3)
    assert broker.settled_count["sms"] == 20


def test_duplicates_get_the_stored_result(redis_conn: redis.Redis, namespace: str) -> None:
    seen: list[tuple[str, Any]] = []

    class Replying(sms_consumer(namespace, effects=redis_conn)):  # type: ignore[misc]
        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            seen.append((str(message.properties["message_id"]), stored_result))

    broker = InMemoryBroker()
    broker.publish("sms", "hi", message_id="sms-1")
    Worker(Replying(), broker.transport("sms"), None).run(until_idle=True)
    for _ in range(2):
        broker.publish("sms", "hi", message_id="sms-1")
    Worker(Replying(), broker.transport("sms"), None).run(until_idle=True)

    assert effects(redis_conn, namespace) == ["sms-1"]
    assert seen == [("sms-1", {"sent": "sms-1"}), ("sms-1", {"sent": "sms-1"})]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[PrivateService, str]]:
    port = free_port()
    service = PrivateService("redis", tmp_path / "state", "REDIS_PORT", port)
    try:
        service.start()
    except RuntimeError as exc:
        require_service("a private Redis instance", str(exc))
    try:
        yield service, f"redis://127.0.0.1:{port}/0"
    finally:
        service.stop()


def test_redis_outage_pauses_and_resumes_without_loss(
    private_redis: tuple[PrivateService, str],
) -> None:
    """Redis down mid-run: the worker waits and retries, dead-letters nothing, loses
    nothing, and finishes once Redis is back. (No persistence: the restarted Redis has
    forgotten the claims, and the effects list lives in the shared one.)"""
    service, url = private_redis
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    namespace = "outage:"
    handled: list[str] = []

    class Small(sms_consumer(namespace, url, effects=client)):  # type: ignore[misc]
        batch_size = 20

        def handle(self, message: Message, ctx: Context) -> Any:
            handled.append(str(message.id))
            return {"sent": message.id}

    broker = InMemoryBroker()
    for number in range(2_000):
        broker.publish("sms", "x", message_id=f"sms-{number}")
    transport = broker.transport("sms")
    stop = StopToken()
    metrics = Metrics()
    worker = Worker(Small(), transport, None, stop=stop, metrics=metrics)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: metrics.processed >= 200, 60, "the worker to get going")
        service.kill()
        wait_for(lambda: metrics.database_retries >= 3, 60, "the worker to notice the outage")
        assert metrics.outage is not None and "redis" in metrics.outage
        assert not snapshot_ready(metrics.snapshot())  # /healthz: not ready meanwhile
        stalled = metrics.processed
        assert not broker.dead_letters  # an outage is never the message's fault
        service.start()
        wait_for(
            lambda: broker.pending("sms") == 0 and transport.in_flight == 0,
            60,
            "the worker to finish after Redis came back",
        )
    finally:
        stop.request()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert not broker.dead_letters
    assert stalled < 2_000
    assert broker.settled_count["sms"] == 2_000
    # The batch in flight kept its place: no handler ran twice, none was skipped.
    assert len(handled) == 2_000 and len(set(handled)) == 2_000
    assert metrics.processed == 2_000
    assert metrics.outage is None and snapshot_ready(metrics.snapshot())  # ready again


def test_unreachable_redis_is_a_one_line_error() -> None:
    from mqdedup.dedup.redis_client import check_redis, redis_client

    client = redis_client(f"redis://:secret@127.0.0.1:{free_port()}/0", timeout=1)
    with pytest.raises(
        RedisUnavailableError, match=r"cannot reach Redis at 127\.0\.0\.1:\d+"
    ) as info:
        check_redis(client)
    assert "secret" not in str(info.value) and "\n" not in str(info.value)


def test_run_entry_point_without_a_database(
    redis_url: str, redis_conn: redis.Redis, namespace: str
) -> None:
    """``run()`` as ``mqdedup worker`` calls it for a Redis-claimed consumer: no database
    (None), Redis from ``dedup.url``, the transport from ``create_transport``."""
    broker = InMemoryBroker()
    for number in range(50):
        broker.publish("sms", "x", message_id=f"sms-{number % 40}")

    class Standalone(sms_consumer(namespace, redis_url, effects=redis_conn)):  # type: ignore[misc]
        def create_transport(self, *, stop: Any = None, metrics: Any = None) -> Any:
            return broker.transport("sms")

    stop, metrics = StopToken(), Metrics()
    thread = threading.Thread(
        target=Standalone().run, args=(None,), kwargs={"stop": stop, "metrics": metrics}
    )
    thread.start()
    try:
        wait_for(lambda: broker.settled_count.get("sms", 0) == 50, 30, "50 settled deliveries")
    finally:
        stop.request()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert sorted(effects(redis_conn, namespace)) == sorted(f"sms-{n}" for n in range(40))
    assert (metrics.processed, metrics.duplicates) == (40, 10)


def test_a_redis_claimed_handler_has_no_transaction(
    redis_conn: redis.Redis, namespace: str
) -> None:
    """``ctx.session`` / ``ctx.outbox`` raise, naming why; the message is dead-lettered
    after its retries like any failing handler, and no claim is left behind."""
    errors: list[str] = []

    class Writer(sms_consumer(namespace, effects=redis_conn)):  # type: ignore[misc]
        def handle(self, message: Message, ctx: Context) -> Any:
            for use in (lambda: ctx.session, lambda: ctx.outbox):
                try:
                    use()
                except NoTransactionError as error:
                    errors.append(str(error))
            raise NoTransactionError(errors[-1])

    broker = InMemoryBroker()
    broker.publish("sms", "x", message_id="sms-1")
    metrics = Worker(Writer(), broker.transport("sms"), None).run(until_idle=True)
    assert errors and all("Redis" in e and "no database transaction" in e for e in errors)
    assert any(e.startswith("ctx.session") for e in errors)
    assert any(e.startswith("ctx.outbox") for e in errors)
    [dead] = broker.dead_letters["sms"]
    assert "ctx.outbox is not available" in dead.record.reason
    assert metrics.dead_lettered == 1 and broker.settled_count["sms"] == 1
    store = RedisClaimStore(redis_conn, namespace=namespace)
    assert redis_conn.get(store.key("sms", "sms-1")) is None


def test_a_message_that_kills_its_worker_is_dead_lettered_alone(
    redis_conn: redis.Redis, namespace: str
) -> None:
    """Careful mode with Redis claims: each redelivered message gets its attempt counted
    in Redis before its handler runs, so a process-killer reaches ``max_attempts`` and
    is dead-lettered unrun; its batch-mates are processed once. (Each death leaves the
    killer's claim leased: the next worker waits out the short lease first.)"""
    runs: Counter[str] = Counter()

    class Killer(sms_consumer(namespace, effects=redis_conn, lease=0.3)):  # type: ignore[misc]
        def handle(self, message: Message, ctx: Context) -> Any:
            runs[str(message.id)] += 1
            if message.id == "sms-3":
                raise SimulatedCrash("the handler killed its process")
            return super().handle(message, ctx)

    broker = InMemoryBroker()
    for number in range(10):
        broker.publish("sms", "x", message_id=f"sms-{number}")
    run = run_until_idle_restarting(Killer(), broker, "sms", None)  # type: ignore[arg-type]

    assert run.crashes == 3 + 1  # the first death was in an ordinary batch, uncounted
    assert runs["sms-3"] == run.crashes
    [dead] = broker.dead_letters["sms"]
    assert dead.message.properties["message_id"] == "sms-3"
    assert (dead.record.reason, dead.record.attempts) == (WORKER_DIED, 3)
    done = effects(redis_conn, namespace)
    assert sorted(done) == sorted(f"sms-{n}" for n in range(10) if n != 3)
    assert len(done) == 9  # no batch-mate twice
    store = RedisClaimStore(redis_conn, namespace=namespace)
    assert store.attempts("sms", "sms-3") == (3, WORKER_DIED)
    assert broker.pending("sms") == 0


def test_a_refused_dead_letter_without_a_database_stays_unsettled(
    redis_conn: redis.Redis, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No dead-letter table to park it in: the message is not acked silently (promise 5);
    it stays with the broker and an error line says why. Its batch-mates settle."""

    class Refusing(MemoryTransport):
        def dead_letter(self, delivery: Delivery, record: DeadLetter) -> None:
            raise DeadLetterRefusedError("MessageSizeTooLargeError: the record is too large")

    consumer = sms_consumer(namespace, effects=redis_conn, fail_ids=frozenset({"sms-2"}))
    broker = InMemoryBroker()
    for number in range(5):
        broker.publish("sms", "x", message_id=f"sms-{number}")
    with caplog.at_level(logging.ERROR, logger="mqdedup.consumers.dead_lettering"):
        metrics = Worker(consumer(), Refusing(broker, "sms"), None).run(max_batches=1)
    assert metrics.dead_letter_failures == 1 and metrics.dead_letters_parked == 0
    assert broker.settled_count["sms"] == 4 and broker.pending("sms") == 1  # sms-2 is back
    assert not broker.dead_letters.get("sms")
    [line] = [r for r in caplog.records if "no database to keep it" in r.getMessage()]
    assert line.consumer == "sms"  # type: ignore[attr-defined]
