"""The Redis claim store, for handlers without a database write (the ``redis`` extra).

Chosen with ``dedup = RedisDedup(...)`` on any consumer (:mod:`mqdedup.dedup.choices`).

Some handlers have nothing to commit: they send an SMS, call an API, touch a file.
For them a database transaction buys nothing, and a Redis key per message id is the
cheaper judge. Each message id of a consumer has one key::

    <namespace>{<consumer name>}:m:<message id>  =  P|<worker>      (claimed, leased)
                                                  =  D|<json result> (done, kept)

In keys the consumer name has ``%``, ``{`` and ``}`` percent-escaped (``%25``, ``%7B``,
``%7D``), so the ``{…}`` Redis Cluster hash tag ends exactly after the name and no
(consumer, id) pair can spell another pair's key (consumer ``a}:m:b`` with id ``c`` and
consumer ``a`` with id ``b}:m:c`` were one key before). Names without those characters
keep their keys.

* **claim**: ``SET key P|<worker> NX PX <lease>``. Only one worker wins; the others see
  ``D|…`` (a duplicate: skip it, and ``on_duplicate`` gets the stored result) or another
  worker's ``P|…`` (busy: the Processor waits until it is done or its lease runs out).
* **success**: right after the handler returns, ``SET key D|<result> PX <retention>``.
* **failure**: the claim is deleted (only if it is still ours) and the message retried
  per the retry policy, then dead-lettered.
* **crash**: nobody deletes the claim; it expires after ``lease`` seconds and the
  redelivered message is processed by whoever claims it next. A worker renews the
  leases of the claims it still holds while it works through a batch.

All batch operations are Lua scripts: one round trip per batch (claims), per message
(completion, so a crash loses as little as possible) or per failure.

Trade-offs (documented in docs/tools.md): this is *at-least-once with a narrow window*,
not the database's exactly-once:

* nothing is atomic with the handler's effect: a crash after the effect and before
  the ``D|`` write (or a handler that outlives its lease) runs the effect again;
* Redis without persistence, or a failover that loses recent writes, forgets claims
  and completions: those messages are processed again if redelivered;
* keys are dropped ``retention`` after completion; a replay older than that repeats.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from mqdedup.dedup import redis_scripts as scripts
from mqdedup.dedup.claims import Claims
from mqdedup.dedup.redis_client import is_transient_redis_error, redis_client
from mqdedup.dedup.redis_settings import DEFAULT_REDIS_NAMESPACE, expiry_seconds
from mqdedup.errors import ConfigurationError
from mqdedup.extras import missing_extra

try:
    import redis
except ImportError as _missing:  # the redis extra
    raise missing_extra("the Redis claim store (RedisDedup)", "redis", _missing) from None

log = logging.getLogger(__name__)


class RedisClaimStore:
    """:class:`~mqdedup.dedup.claims.ClaimStore` in Redis, with leases.

    ``unit`` is the worker id its claims are held under. ``client`` is a
    ``redis.Redis`` or a ``redis://`` URL (default ``MQDEDUP_REDIS_URL``). ``lease`` is
    how long a claim protects a message being processed; ``retention`` how long
    completed ids (and their results) are remembered.
    """

    transactional = False
    infrastructure = "redis"
    lease: float

    def __init__(
        self,
        client: redis.Redis | str | None = None,
        *,
        namespace: str = DEFAULT_REDIS_NAMESPACE,
        lease: timedelta | float = 60.0,
        retention: timedelta | float = timedelta(days=7),
    ) -> None:
        if "{" in namespace or "}" in namespace:
            raise ConfigurationError(
                f"Redis dedup namespace {namespace!r} must not contain '{{' or '}}' "
                "(the consumer name is the keys' Redis Cluster hash tag)"
            )
        self.redis: redis.Redis = redis_client(client)
        self.namespace = namespace
        self.lease = expiry_seconds(lease, "lease")
        self.retention = expiry_seconds(retention, "retention")
        self.lease_ms = max(1, int(self.lease * 1000))
        self.retention_ms = max(1, int(self.retention * 1000))
        self._claim: Any = self.redis.register_script(scripts.CLAIM)
        self._complete: Any = self.redis.register_script(scripts.COMPLETE)
        self._release: Any = self.redis.register_script(scripts.RELEASE)
        self._renew: Any = self.redis.register_script(scripts.RENEW)
        self._start_attempt: Any = self.redis.register_script(scripts.START_ATTEMPT)
        self._undo_attempt: Any = self.redis.register_script(scripts.UNDO_ATTEMPT)

    # -- keys ----------------------------------------------------------------------------

    def key(self, consumer: str, message_id: str) -> str:
        """The claim key of one message id (``{consumer}`` is a Redis Cluster hash tag)."""
        return f"{self.namespace}{{{scope_tag(consumer)}}}:m:{message_id}"

    def attempts_key(self, consumer: str, message_id: str) -> str:
        """The attempts hash of one message id (``n``: attempts, ``e``: the last error)."""
        return f"{self.namespace}{{{scope_tag(consumer)}}}:a:{message_id}"

    def _keys(self, consumer: str, ids: Iterable[str]) -> list[str]:
        return [self.key(consumer, i) for i in ids]

    # -- the claim-store seam ------------------------------------------------------------

    def is_transient(self, error: BaseException) -> bool:
        """Connection lost, timeout, loading, failover (:func:`is_transient_redis_error`)."""
        return is_transient_redis_error(error)

    def claim(self, unit: str, consumer: str, ids: Sequence[str]) -> Claims:
        """Claim ``ids`` for worker ``unit`` in one round trip; say what each one found."""
        claims = Claims()
        if not ids:
            return claims
        answers = self._claim(keys=self._keys(consumer, ids), args=[unit, self.lease_ms])
        for message_id, raw in zip(ids, answers, strict=True):
            answer = raw.decode() if isinstance(raw, bytes) else str(raw)
            if answer == "N":
                claims.new.add(message_id)
            elif answer.startswith("D|"):
                claims.done[message_id] = _load_result(answer[2:])
            else:
                left_ms = int(answer[2:]) if answer[2:].lstrip("-").isdigit() else 0
                claims.busy[message_id] = max(left_ms, 0) / 1000
        return claims

    def results(self, unit: str, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """Stored results of completed ids (one MGET; ids without a result are absent)."""
        if not ids:
            return {}
        values = self.redis.mget(self._keys(consumer, ids))
        found: dict[str, Any] = {}
        for message_id, value in zip(ids, values, strict=True):
            if isinstance(value, bytes) and value.startswith(b"D|"):
                result = _load_result(value[2:].decode())
                if result is not None:
                    found[message_id] = result
        return found

    def save_results(self, unit: str, consumer: str, results: Mapping[str, Any]) -> None:
        """Mark ids done with their JSON results, kept ``retention`` (one round trip).

        A claim no longer held by ``unit`` (its lease ran out) is marked done anyway and
        logged: its effect may have run twice.
        """
        for message_id, answer in self.complete(consumer, results, unit).items():
            if answer != "ok":
                log.warning(
                    "claim was not held when the handler finished; its effect may have run twice",
                    extra={"consumer": consumer, "message_id": message_id, "claim": answer},
                )

    def forget(self, unit: str, consumer: str, ids: Sequence[str]) -> None:
        """Delete the claims of ``ids`` still held by ``unit`` (after a handler failure)."""
        self.release(consumer, ids, unit)

    def renew(self, unit: str, consumer: str, ids: Sequence[str]) -> None:
        """Extend the leases of the claims of ``ids`` still held by ``unit``."""
        if ids:
            self._renew(keys=self._keys(consumer, ids), args=[unit, self.lease_ms])

    def record_failure(self, consumer: str, message_id: str, error: str = "") -> int:
        """Count one failed attempt (kept ``retention``); return the attempts so far."""
        key = self.attempts_key(consumer, message_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hincrby(key, "n", 1)
        pipe.hset(key, "e", error[:2000])
        pipe.pexpire(key, self.retention_ms)
        count, _, _ = pipe.execute()
        return int(count)

    def attempts(self, consumer: str, message_id: str) -> tuple[int, str | None]:
        """The attempts counted for one message id, and the last error recorded."""
        values = self.redis.hmget(self.attempts_key(consumer, message_id), ["n", "e"])
        count, error = values[0], values[1]
        return int(count or 0), error.decode() if isinstance(error, bytes) else None

    def forget_attempts(self, consumer: str, ids: Sequence[str]) -> None:
        """Delete attempt counters (a replay gives those messages their full retries)."""
        if ids:
            self.redis.delete(*(self.attempts_key(consumer, i) for i in ids))

    # -- careful mode: attempts counted before the handler runs ---------------------------

    def processed(self, consumer: str, ids: Sequence[str]) -> dict[str, Any]:
        """The completed ids among ``ids``, with their stored results (one MGET)."""
        if not ids:
            return {}
        values = self.redis.mget(self._keys(consumer, ids))
        return {
            message_id: _load_result(value[2:].decode())
            for message_id, value in zip(ids, values, strict=True)
            if isinstance(value, bytes) and value.startswith(b"D|")
        }

    def start_attempt(
        self, unit: str, consumer: str, message_id: str, marker: str, max_attempts: int
    ) -> tuple[int, str | None, bool]:
        """Count an attempt before its handler runs, unless ``max_attempts`` is reached."""
        count, error, started = self._start_attempt(
            keys=[self.attempts_key(consumer, message_id)],
            args=[marker, max_attempts, self.retention_ms],
        )
        text = error.decode() if isinstance(error, bytes) else error or None
        return int(count), text, bool(started)

    def finish_attempt(self, consumer: str, message_id: str, error: str) -> None:
        """Record how a counted attempt failed (no second count)."""
        self.redis.hset(self.attempts_key(consumer, message_id), "e", error[:2000])

    def undo_attempt(self, consumer: str, message_id: str) -> None:
        """Take back a counted attempt whose handler never ran."""
        self._undo_attempt(keys=[self.attempts_key(consumer, message_id)])

    # -- lower level and operator tools ----------------------------------------------------

    def complete(self, consumer: str, results: Mapping[str, Any], worker: str) -> dict[str, str]:
        """Mark ids done with their JSON results; per id ``ok`` / ``lost`` / ``dup``."""
        if not results:
            return {}
        ids = list(results)
        answers = self._complete(
            keys=self._keys(consumer, ids),
            args=[worker, self.retention_ms, *(json.dumps(results[i]) for i in ids)],
        )
        return {
            i: (a.decode() if isinstance(a, bytes) else str(a))
            for i, a in zip(ids, answers, strict=True)
        }

    def release(self, consumer: str, ids: Sequence[str], worker: str) -> int:
        """Delete the claims of ``ids`` still held by ``worker``; how many were deleted."""
        if not ids:
            return 0
        return int(self._release(keys=self._keys(consumer, ids), args=[worker]))

    def is_processed(self, consumer: str, message_id: str) -> bool:
        """True when ``message_id`` was completed for ``consumer``."""
        value = self.redis.get(self.key(consumer, message_id))
        return isinstance(value, bytes) and value.startswith(b"D|")

    def result(self, consumer: str, message_id: str) -> Any:
        """The stored result of a completed message id (``None`` if none or not done)."""
        value = self.redis.get(self.key(consumer, message_id))
        if isinstance(value, bytes) and value.startswith(b"D|"):
            return _load_result(value[2:].decode())
        return None


def scope_tag(consumer: str) -> str:
    """``consumer`` as the text of a key's hash tag: ``%``, ``{`` and ``}`` escaped.

    Without a ``}`` inside, the tag ends right after the name: keys are unambiguous and
    all keys of one consumer stay in one Redis Cluster slot.
    """
    if "%" not in consumer and "{" not in consumer and "}" not in consumer:
        return consumer
    return consumer.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _load_result(raw: str) -> Any:
    return json.loads(raw) if raw else None
