"""Redis dedup keys are unambiguous: no (consumer, message id) pair spells another's key."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from mqdedup import InMemoryBroker, Message
from mqdedup.dedup.redis_store import (
    ClaimState,
    RedisConsumer,
    RedisContext,
    RedisDedupStore,
    RedisWorker,
)
from mqdedup.errors import ConfigurationError

pytestmark = pytest.mark.integration

# Consumer "a}:m:b" with id "c" and consumer "a" with id "b}:m:c" were one key:
# "<ns>{a}:m:b}:m:c". Queue names (the default consumer name) may contain "}".
PAIRS = [("a}:m:b", "c"), ("a", "b}:m:c")]


def consumer_named(name: str, namespace: str, effects: redis.Redis) -> RedisConsumer:
    class Recorder(RedisConsumer):
        batch_size = 10
        poll_timeout = 0.05
        duplicates_seen: list[Any]

        def handle(self, message: Message, ctx: RedisContext) -> Any:
            effects.rpush(f"{namespace}effects", f"{ctx.consumer_name}|{message.id}")
            return {"consumer": ctx.consumer_name}

        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            self.duplicates_seen.append(stored_result)

    Recorder.name = name
    Recorder.namespace = namespace
    consumer = Recorder()
    consumer.duplicates_seen = []
    return consumer


def test_two_consumers_whose_name_and_id_concatenate_alike_both_process(
    redis_conn: redis.Redis, namespace: str
) -> None:
    store = RedisDedupStore(redis_conn, namespace=namespace)
    results = []
    for name, message_id in PAIRS:
        broker = InMemoryBroker()
        broker.publish("q", "hello", message_id=message_id)
        consumer = consumer_named(name, namespace, redis_conn)
        metrics = RedisWorker(consumer, broker.transport("q"), store).run(until_idle=True)
        results.append((metrics.processed, metrics.duplicates, consumer.duplicates_seen))
        assert store.result(name, message_id) == {"consumer": name}

    assert results == [(1, 0, []), (1, 0, [])]  # the second was not "already done"
    effects = [e.decode() for e in redis_conn.lrange(f"{namespace}effects", 0, -1)]
    assert effects == ["a}:m:b|c", "a|b}:m:c"]
    keys = {store.key(name, message_id) for name, message_id in PAIRS}
    assert len(keys) == 2 and all(redis_conn.exists(key) for key in keys)


def test_the_hash_tag_is_the_whole_consumer_name(redis_conn: redis.Redis, namespace: str) -> None:
    store = RedisDedupStore(redis_conn, namespace=namespace)
    for name in ("a}:m:b", "q{1}", "100%", "orders"):
        key = store.key(name, "x}y")
        tag = key[key.index("{") + 1 : key.index("}")]
        # Redis Cluster hashes only the tag: one slot per consumer, whatever the id.
        assert tag == store.attempts_key(name, "other")[len(namespace) + 1 :].split("}")[0]
        assert "}" not in tag and "{" not in tag
    assert store.key("orders", "m-1") == f"{namespace}{{orders}}:m:m-1"  # unchanged format
    assert store.claim("a}:m:b", ["c"], "w1")["c"].state is ClaimState.NEW
    assert store.claim("a", ["b}:m:c"], "w2")["b}:m:c"].state is ClaimState.NEW


@pytest.mark.parametrize("bad", [{"lease": float("inf")}, {"retention": float("nan")}])
def test_unbounded_lease_or_retention_is_refused(
    redis_conn: redis.Redis, bad: dict[str, float]
) -> None:
    with pytest.raises(ConfigurationError, match="at most"):
        RedisDedupStore(redis_conn, **bad)


def test_a_namespace_with_braces_is_refused(redis_conn: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="must not contain"):
        RedisDedupStore(redis_conn, namespace="app:{x}:")
