"""Redis dedup store for handlers without a database write (the ``redis`` extra).

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
  worker's ``P|…`` (busy: wait until it is done or its lease runs out).
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

import functools
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

import redis
from tenacity import Retrying, retry_if_exception, stop_never, wait_exponential, wait_random

from mqdedup.consumers.base import Consumer, RetryPolicy
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import BatchAbandonedError, BatchReport
from mqdedup.consumers.transport import DeadLetter, Delivery, Transport
from mqdedup.dedup.ids import MessageIdStrategy, from_header
from mqdedup.dedup.redis_client import (
    check_redis,
    is_transient_redis_error,
    redis_client,
)
from mqdedup.errors import ConfigurationError, MessageError
from mqdedup.message import Message
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_NAMESPACE = "mqdedup:dedup:"
#: The longest lease or retention accepted (10 years): Redis expiries are finite.
MAX_EXPIRY_SECONDS = 10 * 365 * 24 * 3600.0
_DEFAULT_IDS = from_header()

# KEYS: claim keys. ARGV[1] worker, ARGV[2] lease ms.
# Per key: 'N' (new: claimed by us), 'D|<json>' (done), 'B|<ms left on the lease>'.
_CLAIM = """
local mine = 'P|' .. ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, mine, 'NX', 'PX', ARGV[2]) then
    out[i] = 'N'
  else
    local value = redis.call('GET', key)
    if (not value) or value == mine then
      redis.call('SET', key, mine, 'PX', ARGV[2])
      out[i] = 'N'
    elseif string.sub(value, 1, 2) == 'D|' then
      out[i] = value
    else
      out[i] = 'B|' .. redis.call('PTTL', key)
    end
  end
end
return out
"""

# KEYS: claim keys. ARGV[1] worker, ARGV[2] retention ms, ARGV[2 + i] result of key i.
# Per key: 'ok' (our claim became done), 'lost' (our lease had run out; marked done
# anyway), 'dup' (another worker had completed it already; left as it was).
_COMPLETE = """
local mine = 'P|' .. ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, 2) == 'D|' then
    out[i] = 'dup'
  else
    redis.call('SET', key, 'D|' .. ARGV[i + 2], 'PX', ARGV[2])
    if value == mine then out[i] = 'ok' else out[i] = 'lost' end
  end
end
return out
"""

# KEYS: claim keys. ARGV[1] worker. Deletes the claims that are still ours.
_RELEASE = """
local mine = 'P|' .. ARGV[1]
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == mine then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
"""

# KEYS: claim keys. ARGV[1] worker, ARGV[2] lease ms. Extends the claims still ours.
_RENEW = """
local mine = 'P|' .. ARGV[1]
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == mine then
    redis.call('PEXPIRE', key, ARGV[2])
    n = n + 1
  end
end
return n
"""


class ClaimState(StrEnum):
    """What a claim attempt found."""

    NEW = "new"
    DONE = "done"
    BUSY = "busy"


@dataclass(frozen=True, slots=True)
class Claim:
    """One message id's claim: new (ours now), done (with its stored result) or busy."""

    state: ClaimState
    result: Any = None
    busy_for: float = 0.0  # seconds left on another worker's lease


class RedisDedupStore:
    """Claims, results and attempt counters of Redis-deduplicated consumers.

    ``client`` is a ``redis.Redis`` or a ``redis://`` URL. ``lease`` is how long a claim
    protects a message being processed (and so how long a crashed worker's messages
    wait); it must exceed the slowest handler. ``retention`` is how long completed ids
    (and their results) are remembered.
    """

    def __init__(
        self,
        client: redis.Redis | str | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
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
        self.lease = _seconds(lease, "lease")
        self.retention = _seconds(retention, "retention")
        self.lease_ms = max(1, int(self.lease * 1000))
        self.retention_ms = max(1, int(self.retention * 1000))
        self._claim: Any = self.redis.register_script(_CLAIM)
        self._complete: Any = self.redis.register_script(_COMPLETE)
        self._release: Any = self.redis.register_script(_RELEASE)
        self._renew: Any = self.redis.register_script(_RENEW)

    # -- keys ----------------------------------------------------------------------------

    def key(self, consumer: str, message_id: str) -> str:
        """The claim key of one message id (``{consumer}`` is a Redis Cluster hash tag)."""
        return f"{self.namespace}{{{scope_tag(consumer)}}}:m:{message_id}"

    def attempts_key(self, consumer: str, message_id: str) -> str:
        """The failed-attempt counter of one message id."""
        return f"{self.namespace}{{{scope_tag(consumer)}}}:a:{message_id}"

    def _keys(self, consumer: str, ids: Iterable[str]) -> list[str]:
        return [self.key(consumer, i) for i in ids]

    # -- operations ----------------------------------------------------------------------

    def claim(self, consumer: str, ids: Sequence[str], worker: str) -> dict[str, Claim]:
        """Claim ``ids`` for ``worker`` in one round trip; say what each one found."""
        if not ids:
            return {}
        answers = self._claim(keys=self._keys(consumer, ids), args=[worker, self.lease_ms])
        claims: dict[str, Claim] = {}
        for message_id, raw in zip(ids, answers, strict=True):
            answer = raw.decode() if isinstance(raw, bytes) else str(raw)
            if answer == "N":
                claims[message_id] = Claim(ClaimState.NEW)
            elif answer.startswith("D|"):
                claims[message_id] = Claim(ClaimState.DONE, _load_result(answer[2:]))
            else:
                left_ms = int(answer[2:]) if answer[2:].lstrip("-").isdigit() else 0
                claims[message_id] = Claim(ClaimState.BUSY, busy_for=max(left_ms, 0) / 1000)
        return claims

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
        """Delete the claims of ``ids`` still held by ``worker`` (after a failure)."""
        if not ids:
            return 0
        return int(self._release(keys=self._keys(consumer, ids), args=[worker]))

    def renew(self, consumer: str, ids: Sequence[str], worker: str) -> int:
        """Extend the leases of the claims of ``ids`` still held by ``worker``."""
        if not ids:
            return 0
        return int(self._renew(keys=self._keys(consumer, ids), args=[worker, self.lease_ms]))

    def record_failure(self, consumer: str, message_id: str) -> int:
        """Count one failed attempt (kept ``retention``); return the attempts so far."""
        key = self.attempts_key(consumer, message_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.incr(key)
        pipe.pexpire(key, self.retention_ms)
        count, _ = pipe.execute()
        return int(count)

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

    def forget(self, consumer: str, ids: Sequence[str]) -> int:
        """Delete the records of ``ids`` (an operator's tool: they will be processed again)."""
        if not ids:
            return 0
        keys = self._keys(consumer, ids) + [self.attempts_key(consumer, i) for i in ids]
        return int(self.redis.delete(*keys))


def scope_tag(consumer: str) -> str:
    """``consumer`` as the text of a key's hash tag: ``%``, ``{`` and ``}`` escaped.

    Without a ``}`` inside, the tag ends right after the name: keys are unambiguous and
    all keys of one consumer stay in one Redis Cluster slot.
    """
    if "%" not in consumer and "{" not in consumer and "}" not in consumer:
        return consumer
    return consumer.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _as_source(cls: type[Consumer]) -> type[Consumer]:
    """``cls`` with a handler that refuses: a source only lends its broker settings."""

    def handle(self: Consumer, message: Message, ctx: Any) -> Any:
        raise RuntimeError(f"{cls.__name__} is a RedisConsumer's source; it handles nothing")

    return type(cls.__name__, (cls,), {"handle": handle, "__module__": cls.__module__})


def _is_rabbitmq(consumer: Consumer) -> bool:
    """True for a RabbitMQConsumer (checked without importing pika for Kafka users)."""
    module = sys.modules.get("mqdedup.rabbitmq.consumer")
    return module is not None and isinstance(consumer, module.RabbitMQConsumer)


def _load_result(raw: str) -> Any:
    return json.loads(raw) if raw else None


def _seconds(value: timedelta | float, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not 0 < seconds <= MAX_EXPIRY_SECONDS:
        raise ConfigurationError(
            f"Redis dedup {what} must be positive and at most {MAX_EXPIRY_SECONDS:.0f} "
            f"seconds (10 years), got {value!r}"
        )
    return seconds


# -- the consumer variant -------------------------------------------------------------------


class RedisContext:
    """What a Redis-deduplicated handler gets besides the message (no database session)."""

    def __init__(self, consumer: RedisConsumer, message: Message) -> None:
        self.consumer = consumer
        self.message = message
        self.log = logging.LoggerAdapter(
            logging.getLogger(f"mqdedup.handler.{consumer.consumer_name}"),
            {"message_id": message.id, "consumer": consumer.consumer_name},
        )

    @property
    def consumer_name(self) -> str:
        """The dedup scope this message is claimed in."""
        return self.consumer.consumer_name


class RedisConsumer:
    """Subclass this and implement :meth:`handle` for handlers without a database write.

    Message ids are claimed in Redis (see :class:`RedisDedupStore`) instead of a
    database table. The broker is settled after the handler's result was recorded.

    Where messages come from: set :attr:`source` to a
    :class:`~mqdedup.kafka.consumer.KafkaConsumer` or
    :class:`~mqdedup.rabbitmq.consumer.RabbitMQConsumer` subclass that names the
    topics / queue and broker settings (its ``handle`` is never called); then
    ``mqdedup worker module:SendSms`` runs this consumer like any other. Or override
    :meth:`create_transport`, or pass a transport to :class:`RedisWorker`.
    """

    #: The dedup scope. Defaults to the class name.
    name: ClassVar[str | None] = None
    batch_size: ClassVar[int] = 100
    poll_timeout: ClassVar[float] = 1.0
    #: How a message's id is found; None: the :attr:`source`'s strategy (e.g. the AMQP
    #: ``message_id`` for RabbitMQ), else the ``message-id`` header.
    message_id_strategy: ClassVar[MessageIdStrategy | None] = None
    retry_policy: ClassVar[RetryPolicy] = RetryPolicy()
    #: Seconds a claim protects a message in progress; must exceed the slowest handler.
    lease: ClassVar[float] = 60.0
    #: How long completed message ids (and their results) are remembered.
    retention: ClassVar[timedelta] = timedelta(days=7)
    namespace: ClassVar[str] = DEFAULT_NAMESPACE
    #: Redis URL; default ``MQDEDUP_REDIS_URL``.
    redis_url: ClassVar[str | None] = None
    #: The broker to read from: a KafkaConsumer or RabbitMQConsumer subclass whose
    #: topic / queue / broker settings are used (its handler is never called).
    source: ClassVar[type[Consumer] | None] = None

    @property
    def consumer_name(self) -> str:
        """The dedup scope of this consumer."""
        return self.name or type(self).__name__

    def message_id(self, message: Message) -> str:
        """The message id of ``message``; raises MissingMessageIdError when it has none."""
        strategy = type(self).message_id_strategy
        if strategy is None:
            source = type(self).source
            strategy = source.message_id_strategy if source is not None else _DEFAULT_IDS
        return strategy(message)

    def handle(self, message: Message, ctx: RedisContext) -> Any:
        """Perform one new message's effect; return a JSON-serialisable result (or None).

        Raise to fail the message (retried, then dead-lettered);
        :class:`~mqdedup.errors.MessageError` dead-letters at once.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        """Called for each duplicate with the first delivery's stored result (or None)."""

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> Transport[Any]:
        """The transport to read from: :attr:`source`'s, unless overridden.

        ``stop`` and ``metrics`` reach transports that take them (RabbitMQ's stops
        consuming on a stop request and reports the queue depth).
        """
        source = self.source_consumer()
        if source is None:
            raise ConfigurationError(
                f"{type(self).__name__} has no transport: set source to a KafkaConsumer or "
                "RabbitMQConsumer subclass, override create_transport(), or pass a transport "
                "to RedisWorker"
            )
        if _is_rabbitmq(source):
            return source.create_transport(stop=stop, metrics=metrics)
        return source.create_transport()

    def source_consumer(self) -> Consumer | None:
        """An instance of :attr:`source` (for its broker settings), or None."""
        return _as_source(self.source)() if self.source is not None else None

    def check_connection(self) -> None:
        """Raise (one line) if Redis or the source's broker cannot be reached.

        Also a ConfigurationError when the consumer has nowhere to read from (no
        :attr:`source` and no :meth:`create_transport` of its own).
        """
        if self.source is None and type(self).create_transport is RedisConsumer.create_transport:
            raise ConfigurationError(
                f"{type(self).__name__} has no transport: set source to a KafkaConsumer or "
                "RabbitMQConsumer subclass, or override create_transport()"
            )
        check_redis(self.create_store().redis)
        source = self.source_consumer()
        if source is not None:
            source.check_connection()

    def lag(self) -> dict[str, int]:
        """The source's backlog (``topic/partition`` or queue -> waiting messages)."""
        source = self.source_consumer()
        lag = getattr(source, "lag", None)
        return dict(lag()) if callable(lag) else {}

    def create_store(self, client: redis.Redis | str | None = None) -> RedisDedupStore:
        """The store for this consumer's settings (Redis from ``client``, else the URL)."""
        return RedisDedupStore(
            client if client is not None else self.redis_url,
            namespace=self.namespace,
            lease=self.lease,
            retention=self.retention,
        )

    def run(
        self,
        connection: Any = None,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> Metrics:
        """Consume until ``stop`` is requested.

        ``connection`` is a ``redis.Redis`` or a ``redis://`` URL; anything else (such as
        the database engine ``mqdedup worker`` passes to every consumer) is ignored, and
        ``redis_url`` / ``MQDEDUP_REDIS_URL`` is used.
        """
        client = connection if isinstance(connection, redis.Redis | str) else None
        store = self.create_store(client)
        check_redis(store.redis)
        stop = stop or StopToken()
        metrics = metrics if metrics is not None else Metrics()
        if type(self).create_transport is RedisConsumer.create_transport:
            transport = self.create_transport(stop=stop, metrics=metrics)
        else:  # a user's override takes no arguments
            transport = self.create_transport()
        try:
            worker = RedisWorker(self, transport, store, stop=stop, metrics=metrics)
        except BaseException:
            transport.close()
            raise
        return worker.run()

    def validate(self) -> None:
        """Raise ConfigurationError for settings that cannot work."""
        if self.batch_size < 1:
            raise ConfigurationError(f"{type(self).__name__}.batch_size must be at least 1")
        if not self.lease > 0:
            raise ConfigurationError(f"{type(self).__name__}.lease must be positive")
        if type(self).handle is RedisConsumer.handle:
            raise ConfigurationError(f"{type(self).__name__} does not implement handle()")
        source = type(self).source
        if source is not None:
            if not (isinstance(source, type) and issubclass(source, Consumer)):
                raise ConfigurationError(
                    f"{type(self).__name__}.source must be a KafkaConsumer or RabbitMQConsumer "
                    f"subclass, not {source!r}"
                )
            self.source_consumer().validate()  # type: ignore[union-attr]


@dataclass
class _Round:
    processed: list[Delivery[Any]] = field(default_factory=list)
    duplicates: list[tuple[Delivery[Any], Any]] = field(default_factory=list)
    failures: list[tuple[Delivery[Any], Exception]] = field(default_factory=list)
    busy: list[tuple[Delivery[Any], float]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)


class RedisProcessor:
    """Runs batches for a :class:`RedisConsumer`: claim → handle → complete → settle.

    The same ack contract as the database processor: a delivery is settled only after
    its completion was written to Redis (or it was a duplicate, or dead-lettered).
    Redis outages are waited out with backoff and never dead-letter anything; each wait
    counts in ``metrics.database_retries`` (the store is this consumer's database).
    """

    def __init__(
        self,
        consumer: RedisConsumer,
        store: RedisDedupStore,
        transport: Transport[Any],
        *,
        metrics: Metrics | None = None,
        stop: StopToken | None = None,
        worker_id: str | None = None,
    ) -> None:
        consumer.validate()
        self.consumer = consumer
        self.store = store
        self.transport = transport
        self.metrics = metrics or Metrics()
        self.stop = stop or StopToken()
        self.name = consumer.consumer_name
        self.policy = consumer.retry_policy
        #: Identifies this worker's claims; unique per processor.
        self.worker_id = worker_id or uuid.uuid4().hex

    def process(self, deliveries: Sequence[Delivery[Any]]) -> BatchReport:
        """Process and settle one batch; returns where each delivery ended."""
        started = time.monotonic()
        report = BatchReport()
        results: dict[str, Any] = {}
        unique, repeats = self._identify(deliveries, report)
        waiting = unique
        while waiting:
            round_ = self._round(waiting)
            self._collect(round_, report, results)
            busy = list(round_.busy)
            for delivery, error in round_.failures:
                busy.extend(self._retry(delivery, error, report, results))
            if not busy:
                break
            waiting = [d for d, _ in busy]
            pause = min(max(min(left for _, left in busy), 0.05), 0.5)
            if not self._pause(pause):
                report.unsettled.extend(waiting)
                break
        self._resolve_repeats(repeats, report, results)
        self._dead_letter(report)
        if report.settled:
            self.transport.settle(report.settled)
        self._count(deliveries, report, started)
        return report

    # -- steps ---------------------------------------------------------------------------

    def _identify(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport
    ) -> tuple[list[Delivery[Any]], list[tuple[Delivery[Any], str]]]:
        unique: list[Delivery[Any]] = []
        repeats: list[tuple[Delivery[Any], str]] = []
        seen: set[str] = set()
        for delivery in deliveries:
            try:
                message_id = self.consumer.message_id(delivery.message)
            except MessageError as error:
                report.dead_lettered.append((delivery, self._record(error, 1)))
                continue
            if message_id in seen:
                repeats.append((delivery, message_id))
                continue
            seen.add(message_id)
            unique.append(Delivery(delivery.message.with_id(message_id), delivery.token))
        return unique, repeats

    def _round(self, deliveries: Sequence[Delivery[Any]]) -> _Round:
        """Claim ``deliveries`` (one round trip) and run the handler for the new ones."""
        outcome = _Round()
        ids = [str(d.message.id) for d in deliveries]
        claims = self._with_redis_retry(lambda: self.store.claim(self.name, ids, self.worker_id))
        claimed_at = time.monotonic()
        new: list[Delivery[Any]] = []
        for delivery in deliveries:
            claim = claims[str(delivery.message.id)]
            if claim.state is ClaimState.NEW:
                new.append(delivery)
            elif claim.state is ClaimState.DONE:
                outcome.duplicates.append((delivery, claim.result))
            else:
                outcome.busy.append((delivery, claim.busy_for))
        for index, delivery in enumerate(new):
            if time.monotonic() - claimed_at > self.store.lease / 3:
                rest = [str(d.message.id) for d in new[index:]]
                self._with_redis_retry(
                    functools.partial(self.store.renew, self.name, rest, self.worker_id)
                )
                claimed_at = time.monotonic()
            self._handle_one(delivery, outcome)
        return outcome

    def _handle_one(self, delivery: Delivery[Any], outcome: _Round) -> None:
        message_id = str(delivery.message.id)
        try:
            result = self.consumer.handle(
                delivery.message, RedisContext(self.consumer, delivery.message)
            )
            json.dumps(result)
        except Exception as error:
            log.info(
                "handler failed",
                extra={
                    "consumer": self.name,
                    "message_id": message_id,
                    "error": f"{type(error).__name__}: {error}",
                },
            )
            self._with_redis_retry(
                lambda: self.store.release(self.name, [message_id], self.worker_id)
            )
            outcome.failures.append((delivery, error))
            return
        answer = self._with_redis_retry(
            lambda: self.store.complete(self.name, {message_id: result}, self.worker_id)
        )
        outcome.results[message_id] = result
        if answer.get(message_id) != "ok":
            log.warning(
                "claim was not held when the handler finished; its effect may have run twice",
                extra={"consumer": self.name, "message_id": message_id, "claim": answer},
            )
        outcome.processed.append(delivery)

    def _collect(self, round_: _Round, report: BatchReport, results: dict[str, Any]) -> None:
        report.processed.extend(round_.processed)
        report.duplicates.extend(d for d, _ in round_.duplicates)
        results.update(round_.results)
        for delivery, stored in round_.duplicates:
            results[str(delivery.message.id)] = stored
            self.consumer.on_duplicate(delivery.message, stored)

    def _retry(
        self,
        delivery: Delivery[Any],
        error: Exception,
        report: BatchReport,
        results: dict[str, Any],
    ) -> list[tuple[Delivery[Any], float]]:
        """Rerun one failed message until done, dead-lettered or busy elsewhere."""
        message_id = str(delivery.message.id)
        while True:
            attempts = self._with_redis_retry(
                functools.partial(self.store.record_failure, self.name, message_id)
            )
            self.metrics.failures += 1
            if isinstance(error, MessageError) or attempts >= self.policy.max_attempts:
                report.dead_lettered.append((delivery, self._record(error, attempts)))
                return []
            if not self._pause(self.policy.backoff(attempts)):
                report.unsettled.append(delivery)
                return []
            self.metrics.retries += 1
            round_ = self._round([delivery])
            self._collect(round_, report, results)
            if not round_.failures:
                return round_.busy
            error = round_.failures[0][1]

    def _resolve_repeats(
        self, repeats: list[tuple[Delivery[Any], str]], report: BatchReport, results: dict[str, Any]
    ) -> None:
        """A repeat inside the batch shares its first copy's fate (and gets its result)."""
        if not repeats:
            return
        fate: dict[str, Any] = {str(d.message.id): "done" for d in report.settled}
        for delivery, record in report.dead_lettered:
            fate[str(delivery.message.id)] = record
        for delivery, message_id in repeats:
            outcome = fate.get(message_id)
            repeat = Delivery(delivery.message.with_id(message_id), delivery.token)
            if outcome == "done":
                report.duplicates.append(repeat)
                self.consumer.on_duplicate(repeat.message, results.get(message_id))
            elif isinstance(outcome, DeadLetter):
                report.dead_lettered.append((repeat, outcome))
            else:
                report.unsettled.append(repeat)

    def _dead_letter(self, report: BatchReport) -> None:
        kept: list[tuple[Delivery[Any], DeadLetter]] = []
        for delivery, record in report.dead_lettered:
            try:
                self.transport.dead_letter(delivery, record)
            except Exception:
                log.exception(
                    "dead-letter failed; the message stays unsettled",
                    extra={"consumer": self.name, "coordinates": delivery.message.coordinates},
                )
                report.unsettled.append(delivery)
                continue
            log.warning(
                "dead-lettered",
                extra={
                    "consumer": self.name,
                    "message_id": delivery.message.id,
                    "reason": record.reason,
                    "attempts": record.attempts,
                },
            )
            kept.append((delivery, record))
        report.dead_lettered = kept

    def _record(self, error: Exception, attempts: int) -> DeadLetter:
        reason = (
            error.reason
            if isinstance(error, MessageError)
            else f"handler failed after {attempts} attempts: {type(error).__name__}: {error}"
        )
        return DeadLetter(
            reason=reason,
            consumer=self.name,
            attempts=attempts,
            error_class=f"{type(error).__module__}.{type(error).__qualname__}",
            error_message=str(error),
        )

    # -- infrastructure ------------------------------------------------------------------

    def _with_redis_retry(self, work: Callable[[], T]) -> T:
        """Run ``work``; while Redis is unreachable, wait with backoff and run it again."""
        retrying = Retrying(
            retry=retry_if_exception(is_transient_redis_error),
            wait=wait_exponential(multiplier=0.1, max=self.policy.infrastructure_backoff_max)
            + wait_random(0, 0.1),
            stop=stop_never,
            sleep=self._infrastructure_sleep,
            before_sleep=self._log_redis_retry,
            reraise=True,
        )
        return retrying(work)

    def _infrastructure_sleep(self, seconds: float) -> None:
        if not self._pause(seconds):
            raise BatchAbandonedError("stop requested while Redis was unavailable")

    def _log_redis_retry(self, state: Any) -> None:
        self.metrics.database_retries += 1
        error = state.outcome.exception() if state.outcome else None
        log.warning(
            "redis unavailable; retrying",
            extra={
                "consumer": self.name,
                "attempt": state.attempt_number,
                "error": type(error).__name__ if error else None,
            },
        )

    def _pause(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if self.stop.requested:
                return False
            self.transport.keepalive()
            self.stop.wait(min(remaining, 0.2))
        return not self.stop.requested

    def _count(
        self, deliveries: Sequence[Delivery[Any]], report: BatchReport, started: float
    ) -> None:
        metrics = self.metrics
        metrics.batches += 1
        metrics.delivered += len(deliveries)
        metrics.processed += len(report.processed)
        metrics.duplicates += len(report.duplicates)
        metrics.dead_lettered += len(report.dead_lettered)
        metrics.batch_seconds += time.monotonic() - started


class RedisWorker:
    """The worker loop for a :class:`RedisConsumer` (fetch, process, repeat)."""

    def __init__(
        self,
        consumer: RedisConsumer,
        transport: Transport[Any],
        store: RedisDedupStore | None = None,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.consumer = consumer
        self.transport = transport
        self.stop = stop or StopToken()
        self.metrics = metrics or Metrics()
        self.processor = RedisProcessor(
            consumer,
            store or consumer.create_store(),
            transport,
            metrics=self.metrics,
            stop=self.stop,
        )

    def run(self, *, until_idle: bool = False, max_batches: int | None = None) -> Metrics:
        """Process batches until stopped (or idle); close the transport; return counters."""
        batches = 0
        log.info("redis worker started", extra={"consumer": self.consumer.consumer_name})
        try:
            while not self.stop.requested:
                deliveries = self.transport.fetch(
                    self.consumer.batch_size, self.consumer.poll_timeout
                )
                if not deliveries:
                    if until_idle:
                        break
                    continue
                try:
                    self.processor.process(deliveries)
                except BatchAbandonedError:
                    log.warning(
                        "batch abandoned unsettled on stop", extra={"size": len(deliveries)}
                    )
                    break
                batches += 1
                if max_batches is not None and batches >= max_batches:
                    break
        finally:
            self.transport.close()
        log.info(
            "redis worker stopped",
            extra={
                "consumer": self.consumer.consumer_name,
                **self.metrics.snapshot(histograms=False),
            },
        )
        return self.metrics
