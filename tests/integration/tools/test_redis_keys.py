"""Redis dedup keys are unambiguous: no (consumer, message id) pair spells another's key."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from mqdedup import Consumer, Context, InMemoryBroker, Message, RedisDedup, Worker
from mqdedup.dedup.redis_claims import RedisClaimStore
from mqdedup.errors import ConfigurationError

pytestmark = pytest.mark.integration

# Consumer "a}:m:b" with id "c" and consumer "a" with id "b}:m:c" were one key:
# "<ns>{a}:m:b}:m:c". Queue names (the default consumer name) may contain "}".
PAIRS = [("a}:m:b", "c"), ("a", "b}:m:c")]


def consumer_named(name: str, namespace: str, effects: redis.Redis) -> Consumer:
    class Recorder(Consumer):
        batch_size = 10
        poll_timeout = 0.05
        duplicates_seen: list[Any]

        def handle(self, message: Message, ctx: Context) -> Any:
            effects.rpush(f"{namespace}effects", f"{ctx.consumer_name}|{message.id}")
            return {"consumer": ctx.consumer_name}

        def on_duplicate(self, message: Message, stored_result: Any) -> None:
            self.duplicates_seen.append(stored_result)

    Recorder.name = name
    Recorder.dedup = RedisDedup(namespace=namespace)
    consumer = Recorder()
    consumer.duplicates_seen = []
    return consumer


def test_two_consumers_whose_name_and_id_concatenate_alike_both_process(
    redis_conn: redis.Redis, namespace: str
) -> None:
    store = RedisClaimStore(redis_conn, namespace=namespace)
    results = []
    for name, message_id in PAIRS:
        broker = InMemoryBroker()
        broker.publish("q", "hello", message_id=message_id)
        consumer = consumer_named(name, namespace, redis_conn)
        metrics = Worker(consumer, broker.transport("q"), None).run(until_idle=True)
        results.append((metrics.processed, metrics.duplicates, consumer.duplicates_seen))
        assert store.result(name, message_id) == {"consumer": name}

    assert results == [(1, 0, []), (1, 0, [])]  # the second was not "already done"
    effects = [e.decode() for e in redis_conn.lrange(f"{namespace}effects", 0, -1)]
    assert effects == ["a}:m:b|c", "a|b}:m:c"]
    keys = {store.key(name, message_id) for name, message_id in PAIRS}
    assert len(keys) == 2 and all(redis_conn.exists(key) for key in keys)


def test_the_hash_tag_is_the_whole_consumer_name(redis_conn: redis.Redis, namespace: str) -> None:
    store = RedisClaimStore(redis_conn, namespace=namespace)
    for name in ("a}:m:b", "q{1}", "100%", "orders"):
        key = store.key(name, "x}y")
        tag = key[key.index("{") + 1 : key.index("}")]
        # Redis Cluster hashes only the tag: one slot per consumer, whatever the id.
        assert tag == store.attempts_key(name, "other")[len(namespace) + 1 :].split("}")[0]
        assert "}" not in tag and "{" not in tag
    assert store.key("orders", "m-1") == f"{namespace}{{orders}}:m:m-1"  # unchanged format
    assert store.claim("w1", "a}:m:b", ["c"]).new == {"c"}
    assert store.claim("w2", "a", ["b}:m:c"]).new == {"b}:m:c"}


@pytest.mark.parametrize("bad", [{"lease": float("inf")}, {"retention": float("nan")}])
def test_unbounded_lease_or_retention_is_refused(
    redis_conn: redis.Redis, bad: dict[str, float]
) -> None:
    with pytest.raises(ConfigurationError, match="at most"):
        RedisDedup(**bad)


def test_a_namespace_with_braces_is_refused(redis_conn: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="must not contain"):
        RedisDedup(namespace="app:{x}:")
