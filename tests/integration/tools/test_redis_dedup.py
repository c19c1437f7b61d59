"""The Redis dedup store against a real Redis: duplicates, a killed worker, failures, outages."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from mqdedup import InMemoryBroker, Message, RetryPolicy
from mqdedup.consumers.metrics import Metrics
from mqdedup.dedup.redis_client import RedisUnavailableError
from mqdedup.dedup.redis_store import RedisConsumer, RedisContext, RedisDedupStore, RedisWorker
from mqdedup.stopping import StopToken
from tests.services import REPO, PrivateService, free_port, require_service, wait_for

pytestmark = pytest.mark.integration
FAST_RETRY = RetryPolicy(
    max_attempts=3, initial_backoff=0.01, max_backoff=0.05, infrastructure_backoff_max=0.5
)


def sms_consumer(namespace: str, **attributes: Any) -> type[RedisConsumer]:
    """A consumer whose effect is an entry in the Redis list ``<namespace>effects``."""

    class Sms(RedisConsumer):
        name = "sms"
        batch_size = 200
        poll_timeout = 0.05
        retry_policy = FAST_RETRY
        fail_ids: frozenset[str] = frozenset()
        flaky_ids: frozenset[str] = frozenset()
        effects: redis.Redis

        def handle(self, message: Message, ctx: RedisContext) -> Any:
            if message.id in self.fail_ids:
                raise RuntimeError(f"provider refused {message.id}")
            if message.id in self.flaky_ids and self.effects.incr(f"{namespace}tries") == 1:
                raise ConnectionResetError("provider hung up")
            self.effects.rpush(f"{namespace}effects", str(message.id))
            return {"sent": message.id}

    Sms.namespace = namespace
    for key, value in attributes.items():
        setattr(Sms, key, value)
    return Sms


def effects(client: redis.Redis, namespace: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"{namespace}effects", 0, -1)]


def test_10k_deliveries_with_30pct_duplicates_two_workers(
    redis_conn: redis.Redis, namespace: str
) -> None:
    """Two workers share one queue: every unique message's effect happens exactly once."""
    consumer = sms_consumer(namespace, effects=redis_conn)
    broker = InMemoryBroker(seed=5)
    for number in range(10_000):
        broker.publish("sms", f"text {number}", message_id=f"sms-{number}")
    copies = broker.inject_duplicates("sms", 0.3)
    assert 2_700 < copies < 3_300

    workers = [
        RedisWorker(
            consumer(), broker.transport("sms"), RedisDedupStore(redis_conn, namespace=namespace)
        )
        for _ in range(2)
    ]
    threads = [threading.Thread(target=w.run, kwargs={"until_idle": True}) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)

    done = effects(redis_conn, namespace)
    assert len(done) == 10_000 and len(set(done)) == 10_000
    processed = sum(w.metrics.processed for w in workers)
    duplicates = sum(w.metrics.duplicates for w in workers)
    assert (processed, duplicates) == (10_000, copies)
    assert broker.settled_count["sms"] == 10_000 + copies
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

    store = RedisDedupStore(redis_conn, namespace=namespace, lease=lease)
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
    worker = RedisWorker(consumer(), broker.transport("sms"), store)
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
    store = RedisDedupStore(redis_conn, namespace=namespace)
    metrics = RedisWorker(consumer(), broker.transport("sms"), store).run(until_idle=True)

    done = effects(redis_conn, namespace)
    assert sorted(done) == sorted(f"sms-{n}" for n in range(20) if n != 13)
    assert len(done) == 19  # sms-7 failed once, then its retry succeeded once
    [dead] = broker.dead_letters["sms"]
    assert dead.message.properties["message_id"] == "sms-13" and dead.record.attempts == 3
    assert "RuntimeError: provider refused sms-13" in dead.record.reason
    assert redis_conn.get(store.key("sms", "sms-13")) is None  # no claim left behind
    assert int(redis_conn.get(store.attempts_key("sms", "sms-13")) or 0) == 3
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (19, 1, 3)
    assert broker.settled_count["sms"] == 20


def test_duplicates_get_the_stored_result(redis_conn: redis.Redis, namespace: str) -> None:
    seen: list[tuple[str, Any]] = []

    class Replying(sms_consumer(namespace, effects=redis_conn)):  # type: ignore[misc]
        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            seen.append((str(message.properties["message_id"]), stored_result))

    broker = InMemoryBroker()
    store = RedisDedupStore(redis_conn, namespace=namespace)
    broker.publish("sms", "hi", message_id="sms-1")
    RedisWorker(Replying(), broker.transport("sms"), store).run(until_idle=True)
    for _ in range(2):
        broker.publish("sms", "hi", message_id="sms-1")
    RedisWorker(Replying(), broker.transport("sms"), store).run(until_idle=True)

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

    class Small(sms_consumer(namespace, effects=client)):  # type: ignore[misc]
        batch_size = 20

        def handle(self, message: Message, ctx: RedisContext) -> Any:
            handled.append(str(message.id))
            return {"sent": message.id}

    broker = InMemoryBroker()
    for number in range(2_000):
        broker.publish("sms", "x", message_id=f"sms-{number}")
    transport = broker.transport("sms")
    stop = StopToken()
    metrics = Metrics()
    worker = RedisWorker(
        Small(), transport, RedisDedupStore(client, namespace=namespace), stop=stop, metrics=metrics
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: metrics.processed >= 200, 60, "the worker to get going")
        service.kill()
        wait_for(lambda: metrics.database_retries >= 3, 60, "the worker to notice the outage")
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


def test_unreachable_redis_is_a_one_line_error() -> None:
    from mqdedup.dedup.redis_client import check_redis, redis_client

    client = redis_client(f"redis://:secret@127.0.0.1:{free_port()}/0", timeout=1)
    with pytest.raises(
        RedisUnavailableError, match=r"cannot reach Redis at 127\.0\.0\.1:\d+"
    ) as info:
        check_redis(client)
    assert "secret" not in str(info.value) and "\n" not in str(info.value)


def test_run_entry_point_with_its_own_transport(
    redis_url: str, redis_conn: redis.Redis, namespace: str
) -> None:
    """``run()`` as ``mqdedup worker`` calls it: (engine, stop=, metrics=); the engine is
    ignored, Redis comes from ``redis_url``, the transport from ``create_transport``."""
    broker = InMemoryBroker()
    for number in range(50):
        broker.publish("sms", "x", message_id=f"sms-{number % 40}")

    class Standalone(sms_consumer(namespace, effects=redis_conn)):  # type: ignore[misc]
        def create_transport(self) -> Any:
            return broker.transport("sms")

    Standalone.redis_url = redis_url
    stop, metrics = StopToken(), Metrics()
    thread = threading.Thread(
        target=Standalone().run, args=(object(),), kwargs={"stop": stop, "metrics": metrics}
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
