"""A kafka-python producer that recovers from a fatal state, and per-record outcomes.

Shared by the dead-letter producer of :mod:`mqdedup.kafka.transport` and the
relay's :mod:`mqdedup.kafka.publisher`.

Why it is needed: kafka-python's idempotent producer (``enable_idempotence=True``, no
transactional id) treats *every* non-retriable produce error as fatal. When the broker
refuses one record (``MessageSizeTooLargeError`` because of the topic's
``max.message.bytes``, an invalid topic, a missing authorisation), the producer enters
a fatal state, aborts every other incomplete batch with that same error, including
batches already sent and possibly appended to the log, and fails every later send.
One record's fault would outlive that record.

:class:`RecoveringProducer` therefore:

* tells the record the broker really refused (its batch completed as *failed*) from the
  records that were only *aborted* with it (their batch never got its answer);
* closes a producer that went fatal and opens a fresh one;
* sends the aborted records again on the fresh producer, so they are published (an
  aborted record may already be on the log: sending it again makes a duplicate with
  the same message id, which the consumers' dedup absorbs; reporting it as refused
  would be wrong);
* reports, per record, ``PUBLISHED``, ``REFUSED`` (the record's own, permanent fault),
  ``UNAVAILABLE`` (an outage or a timeout: try again later) or ``NO_METADATA`` (the
  topic's metadata did not arrive: missing topic or outage, the caller decides).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import kafka
import kafka.errors as kafka_errors
from kafka.partitioner import DefaultPartitioner, murmur2

from mqdedup.kafka.records import describe_error

log = logging.getLogger(__name__)

#: Errors that are the record's own fault: sending the same bytes again cannot succeed.
REFUSAL_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidRecordError,
    kafka_errors.PolicyViolationError,
    ValueError,
    TypeError,
)
#: Errors of the producer's own state (a broken idempotent sequence, a fenced or
#: closed producer): the record is not at fault; a fresh producer sends it again.
PRODUCER_STATE_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.IllegalStateError,
    kafka_errors.OutOfOrderSequenceNumberError,
    kafka_errors.UnknownProducerIdError,
    kafka_errors.InvalidProducerEpochError,
    kafka_errors.ProducerFencedError,
)
#: Refusals of the *producer* (not of a record): the client may not write at all, e.g.
#: no IdempotentWrite permission. Every record would fail alike, so they are outages to
#: fix in the configuration, never a record's fate.
PRODUCER_REFUSED_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.TransactionalIdAuthorizationFailedError,
)
#: Rounds of "send, replace the fatal producer, send the aborted records again" per call.
#: Every round settles at least the record that made the producer fatal.
MAX_ROUNDS = 6


class SendOutcome(enum.Enum):
    """What became of one record."""

    PUBLISHED = "published"
    REFUSED = "refused"
    UNAVAILABLE = "unavailable"
    NO_METADATA = "no_metadata"


@dataclass(frozen=True, slots=True)
class Sent:
    """The outcome of one record, with the error text when it was not published."""

    outcome: SendOutcome
    error: str | None = None
    exception: BaseException | None = None

    @property
    def ok(self) -> bool:
        """True when the broker acknowledged the record."""
        return self.outcome is SendOutcome.PUBLISHED


SENT = Sent(SendOutcome.PUBLISHED)


class ProducerRecord(NamedTuple):
    """One record to send: topic, key, value and ``(name, bytes)`` headers."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


class KeyHashPartitioner(DefaultPartitioner):  # type: ignore[misc]
    """kafka-python's default partitioner with each key's hash remembered.

    The same partition as :class:`~kafka.partitioner.DefaultPartitioner` (and the Java
    client): ``murmur2(key) & 0x7fffffff`` modulo the topic's partition count, a random
    partition for records without a key. kafka-python computes murmur2 in pure Python
    (~3 µs per record); an outbox publishes the same keys (aggregates) again and again,
    so their hashes are kept, up to ``max_keys`` (then the memory starts over).
    """

    def __init__(self, max_keys: int = 100_000) -> None:
        self.max_keys = max_keys
        self._hashes: dict[bytes, int] = {}

    def partition(
        self,
        topic: str,
        key: Any,
        serialized_key: Any,
        value: Any,
        serialized_value: Any,
        cluster: Any,
    ) -> Any:
        """The partition of one record (see the class)."""
        if type(serialized_key) is not bytes:  # no key (random), or an unhashable buffer
            return super().partition(topic, key, serialized_key, value, serialized_value, cluster)
        hashed = self._hashes.get(serialized_key)
        if hashed is None:
            if len(self._hashes) >= self.max_keys:
                self._hashes.clear()
            hashed = self._hashes[serialized_key] = murmur2(serialized_key) & 0x7FFFFFFF
        known = cluster.partitions_for_topic(topic)  # None: no metadata for it yet
        if known is None:
            raise ValueError(f"Topic {topic} not found in ClusterMetadata")
        partitions = sorted(known)
        return partitions[hashed % len(partitions)]


class RecoveringProducer:
    """A lazily created ``kafka.KafkaProducer`` that is replaced when it goes fatal.

    ``config`` is passed to ``KafkaProducer``; ``name`` labels the log lines. Thread
    safe: calls to :meth:`send_all` are serialised (dead letters and relay batches are
    sent one call at a time anyway).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        name: str,
        factory: Callable[..., Any] | None = None,
    ) -> None:
        self.config = dict(config)
        self.name = name
        #: Makes a producer from ``config`` (``kafka.KafkaProducer``; tests pass fakes).
        self.factory: Callable[..., Any] = factory or kafka.KafkaProducer
        self.replacements = 0
        self._producer: Any = None
        self._lock = threading.Lock()  # guards _producer and _closed (held briefly)
        self._send_lock = threading.Lock()  # one send_all at a time
        self._closed = False

    # -- life cycle ------------------------------------------------------------------------

    def get(self) -> Any:
        """The current producer, created on first use (raises kafka-python's errors)."""
        with self._lock:
            if self._closed:
                raise kafka_errors.IllegalStateError(f"the {self.name} producer is closed")
            if self._producer is None:
                self._producer = self.factory(**self.config)
            return self._producer

    def reset(self, reason: str) -> None:
        """Close the current producer at once (its pending records are aborted)."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is None:
            return
        self.replacements += 1
        log.warning(
            "kafka producer in a failed state; replacing it",
            extra={"producer": self.name, "error": reason, "replacements": self.replacements},
        )
        _close(producer, 0.0)

    def close(self, timeout: float) -> None:
        """Flush what can be flushed within ``timeout`` seconds and close."""
        with self._lock:
            self._closed = True
            producer, self._producer = self._producer, None
        if producer is not None:
            _close(producer, timeout)

    # -- sending ---------------------------------------------------------------------------

    def send_all(self, records: Sequence[ProducerRecord], timeout: float) -> list[Sent]:
        """Send ``records`` in order, flush, and report each one's outcome.

        Records aborted because *another* record made the producer fatal are sent again
        on a fresh producer (up to :data:`MAX_ROUNDS` rounds, all within ``timeout``
        seconds; what is still open after that is ``UNAVAILABLE``). Never raises for
        broker failures.
        """
        deadline = time.monotonic() + timeout
        with self._send_lock:
            results: list[Sent | None] = [None] * len(records)
            pending = list(range(len(records)))
            isolate = False
            for _ in range(MAX_ROUNDS):
                if not pending or time.monotonic() >= deadline:
                    break
                if isolate:  # the abort marker is unreadable: one record at a time
                    retry: list[int] = []
                    for index in pending:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            retry.append(index)
                            continue
                        retry += self._round(records, [index], results, left)
                    pending = retry
                else:
                    pending, isolate = self._round_marked(
                        records, pending, results, deadline - time.monotonic()
                    )
            for index in pending:
                results[index] = Sent(
                    SendOutcome.UNAVAILABLE,
                    "aborted by another record's producer failure and not sent again in time",
                )
            return [
                r if r is not None else Sent(SendOutcome.UNAVAILABLE, "not sent") for r in results
            ]

    def _round_marked(
        self,
        records: Sequence[ProducerRecord],
        indexes: list[int],
        results: list[Sent | None],
        timeout: float,
    ) -> tuple[list[int], bool]:
        aborted = self._round(records, indexes, results, timeout)
        unknown = [i for i in aborted if results[i] is not None]
        for index in unknown:
            results[index] = None
        return aborted, bool(unknown)

    def _round(
        self,
        records: Sequence[ProducerRecord],
        indexes: list[int],
        results: list[Sent | None],
        timeout: float,
    ) -> list[int]:
        """One send + flush of ``indexes``; return the indexes to send again.

        An index returned with ``results[index]`` still set means "aborted or refused,
        cannot tell" (kafka-python internals changed): the caller isolates it.
        """
        try:
            producer = self.get()
        except Exception as error:
            for index in indexes:
                results[index] = _unavailable(error)
            return []
        futures: dict[int, Any] = {}
        no_metadata: dict[str, Sent] = {}
        for index in indexes:
            record = records[index]
            known = no_metadata.get(record.topic)
            if known is not None:  # waiting max_block_ms once per topic is enough
                results[index] = known
                continue
            try:
                futures[index] = producer.send(
                    record.topic, key=record.key, value=record.value, headers=record.headers
                )
            except kafka_errors.KafkaTimeoutError as error:
                # The topic's metadata did not arrive within max_block_ms.
                results[index] = no_metadata[record.topic] = Sent(
                    SendOutcome.NO_METADATA, describe_error(error), error
                )
            except REFUSAL_ERRORS as error:  # checked on the client: too large, bad header
                results[index] = Sent(SendOutcome.REFUSED, describe_error(error), error)
            except Exception as error:
                results[index] = _classify(error)
        if futures:
            _flush(producer, futures.values(), timeout)
        again: list[int] = []
        fatal: BaseException | None = None
        for index, future in futures.items():
            if not future.is_done:
                results[index] = Sent(
                    SendOutcome.UNAVAILABLE, f"not acknowledged within {timeout} s"
                )
                continue
            if future.succeeded():
                results[index] = SENT
                continue
            failure = future.exception
            if isinstance(failure, PRODUCER_STATE_ERRORS):
                fatal = failure
                again.append(index)
                continue
            aborted = _was_aborted(future)
            if aborted or type(failure) is kafka_errors.KafkaError:
                # Aborted with another record's failure, or an innocent batch-mate of an
                # invalid record (kafka-python fails those with a bare KafkaError).
                fatal = failure
                again.append(index)
                continue
            result = _classify(failure)
            if isinstance(failure, PRODUCER_REFUSED_ERRORS):
                # kafka-python makes the producer fatal with it (e.g. InitProducerId
                # refused): a fresh producer, once the permission is there, can write.
                fatal = fatal or failure
            if result.outcome is SendOutcome.REFUSED:
                fatal = fatal or failure  # kafka-python's idempotent producer is fatal now
                if aborted is None and len(indexes) > 1:
                    # Refused or aborted with the refused record? Only a send alone tells.
                    results[index] = result
                    again.append(index)
                    continue
            results[index] = result
        if fatal is not None:
            self.reset(describe_error(fatal))
        return again


def _flush(producer: Any, futures: Iterable[Any], timeout: float) -> None:
    """Flush, then wait for every future up to ``timeout`` seconds in all.

    ``KafkaProducer.flush`` alone is not enough: it gives up early ("Future not done")
    when a batch the broker found too large was split and sent again as smaller ones.
    """
    deadline = time.monotonic() + timeout
    try:
        producer.flush(timeout=timeout)
    except kafka_errors.KafkaError as error:
        log.debug("kafka flush returned early", extra={"error": describe_error(error)})
    for future in futures:
        remaining = deadline - time.monotonic()
        if future.is_done or remaining <= 0:
            continue
        with contextlib.suppress(Exception):  # the outcome is read from the future
            future.get(timeout=remaining)


def _was_aborted(future: Any) -> bool | None:
    """True when the record's batch was aborted (never answered), False when the broker
    answered it (or the client failed it), None when kafka-python's internals changed.

    kafka-python completes a batch the broker refused with ``base_offset=None`` and a
    batch aborted because the producer went fatal with ``base_offset=-1``. It tells only
    through the record future's ``_produce_future`` (an internal): with it, a refused
    record's aborted batch-mates go again in one round on the fresh producer; without it
    (None) each suspect is sent alone, the public-API fallback (a 2,000-record batch with
    one refused record: 0.26–0.43 s against 2.05–2.17 s on loopback, where a round trip
    costs least). See docs/architecture.md, "Third-party internals in the adapters".
    """
    produce_future = getattr(future, "_produce_future", None)  # kafka-python internal
    if produce_future is None:
        return None
    if not getattr(produce_future, "is_done", False):
        return False  # failed before reaching a batch (metadata, serialisation)
    value = getattr(produce_future, "value", None)
    if not isinstance(value, tuple) or len(value) != 3:
        return None
    return bool(value[0] == -1)


def _classify(error: BaseException | None) -> Sent:
    """A failed record: refused for its own reason, else unavailable."""
    text = describe_error(error)
    if isinstance(error, PRODUCER_REFUSED_ERRORS):
        return Sent(SendOutcome.UNAVAILABLE, text, error)
    if isinstance(error, REFUSAL_ERRORS):
        return Sent(SendOutcome.REFUSED, text, error)
    if isinstance(error, kafka_errors.BrokerResponseError) and not error.retriable:
        # A non-retriable answer of the broker about this record's batch.
        return Sent(SendOutcome.REFUSED, text, error)
    return Sent(SendOutcome.UNAVAILABLE, text, error)


def _unavailable(error: BaseException) -> Sent:
    return Sent(SendOutcome.UNAVAILABLE, describe_error(error), error)


@contextlib.contextmanager
def admin_for(config: Mapping[str, Any]) -> Iterator[Any]:
    """A ``KafkaAdminClient`` with the settings of ``config`` it knows; closed quietly."""
    known = kafka.KafkaAdminClient.DEFAULT_CONFIG
    admin = kafka.KafkaAdminClient(**{k: v for k, v in config.items() if k in known})
    try:
        yield admin
    finally:
        try:
            admin.close()
        except Exception:
            log.debug("admin client close failed", exc_info=True)


def topic_exists(config: Mapping[str, Any], topic: str, client: str) -> bool | None:
    """Whether ``topic`` exists, asked through an admin client (None: no answer).

    Producers ask it when a topic's metadata did not arrive: a missing topic the broker
    does not create is the record's fault, an unanswered question is an outage.
    """
    try:
        with admin_for(config) as admin:
            return topic in set(admin.list_topics())
    except Exception as error:
        log.warning(
            "cannot ask Kafka for its topics",
            extra={"client": client, "error": describe_error(error)},
        )
        return None


def _close(producer: Any, timeout: float) -> None:
    try:
        producer.close(timeout=timeout)
    except Exception as error:  # pending records could not be flushed: they are dropped
        log.debug("kafka producer closed with pending records", extra={"error": str(error)})
