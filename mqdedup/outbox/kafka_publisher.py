"""Kafka publisher of the relay (kafka-python): ``acks=all``, idempotent, one flush per batch.

Each record goes to its topic with its key, payload and headers (``message-id`` among
them); the batch is flushed once and a record counts as published only when the broker
acknowledged it with ``acks=all``. The idempotent producer keeps each partition's
records in order across its internal retries.

Classification: errors of the record itself (too large, invalid topic, not authorised,
invalid record) are ``REJECTED``; everything retriable (no connection, timeouts, leader
changes) is ``UNAVAILABLE``. A topic whose metadata cannot be fetched while the cluster
answers for other records is ``REJECTED`` (unknown topic), else ``UNAVAILABLE``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kafka import KafkaProducer
from kafka import errors as kafka_errors

from mqdedup.outbox.publishers import PUBLISHED, OutboxRecord, PublishResult, header_text

log = logging.getLogger(__name__)

#: Errors that are the record's own fault: retrying the same bytes cannot help soon.
_RECORD_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidRecordError,
    ValueError,
    TypeError,
)
#: Producer states after which a fresh producer is needed (the record is not at fault).
_FATAL_PRODUCER_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.IllegalStateError,
    kafka_errors.OutOfOrderSequenceNumberError,
    kafka_errors.UnknownProducerIdError,
    kafka_errors.InvalidProducerEpochError,
    kafka_errors.ProducerFencedError,
)
#: After a successful acknowledgement, the cluster counts as reachable for this long.
_REACHABLE_FOR = 60.0


class KafkaPublisher:
    """Publishes outbox records to Kafka.

    ``bootstrap_servers``: ``host:port[,host:port]``. ``flush_timeout`` bounds the wait
    for acknowledgements per batch; ``metadata_timeout`` bounds the wait for a topic's
    metadata (``max_block_ms``). ``producer_config`` overrides other KafkaProducer
    settings (``acks`` and idempotence stay as set here unless overridden explicitly).
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        *,
        flush_timeout: float = 30.0,
        metadata_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        client_id: str = "mqdedup-relay",
        producer_config: Mapping[str, Any] | None = None,
    ) -> None:
        servers = (
            [s.strip() for s in bootstrap_servers.split(",") if s.strip()]
            if isinstance(bootstrap_servers, str)
            else list(bootstrap_servers)
        )
        if not servers:
            from mqdedup.errors import ConfigurationError

            raise ConfigurationError("Kafka bootstrap servers are empty")
        self.flush_timeout = flush_timeout
        self.config: dict[str, Any] = {
            "bootstrap_servers": servers,
            "client_id": client_id,
            "acks": "all",
            "enable_idempotence": True,
            "max_block_ms": int(metadata_timeout * 1000),
            "bootstrap_timeout_ms": int(connect_timeout * 1000),
            "request_timeout_ms": int(min(flush_timeout, 30.0) * 1000),
            "delivery_timeout_ms": int(max(flush_timeout * 2, 30.0) * 1000),
            **(producer_config or {}),
        }
        self._producer: Any = None
        self._last_ack = 0.0

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        """Send every record, flush once, and report each record's outcome."""
        try:
            producer = self._get_producer()
        except Exception as error:  # the cluster cannot be reached at all
            return [PublishResult.unavailable(_describe(error))] * len(records)
        results: list[PublishResult | None] = [None] * len(records)
        futures: list[Any] = [None] * len(records)
        topic_errors: dict[str, PublishResult] = {}
        for index, record in enumerate(records):
            known = topic_errors.get(record.destination)
            if known is not None:
                results[index] = known
                continue
            try:
                futures[index] = producer.send(
                    record.destination,
                    value=record.payload,
                    key=record.key,
                    headers=[(k, header_text(v).encode()) for k, v in record.headers.items()],
                )
            except kafka_errors.KafkaTimeoutError as error:
                # Metadata of this topic did not arrive within max_block_ms.
                result = self._metadata_failure(record.destination, error)
                topic_errors[record.destination] = results[index] = result
            except Exception as error:
                results[index] = self._classify(error)
        try:
            producer.flush(timeout=self.flush_timeout)
        except kafka_errors.KafkaError as error:
            log.warning("Kafka flush incomplete", extra={"error": _describe(error)})
        for index, future in enumerate(futures):
            if future is None:
                continue
            if not future.is_done:
                results[index] = PublishResult.unavailable(
                    f"not acknowledged within {self.flush_timeout} s"
                )
            elif future.succeeded():
                results[index] = PUBLISHED
            else:
                results[index] = self._classify(future.exception)
        if any(result is PUBLISHED for result in results):
            self._last_ack = time.monotonic()
        return [r if r is not None else PublishResult.unavailable("not sent") for r in results]

    def keepalive(self) -> None:
        """The producer's own thread keeps its connections alive."""

    def close(self) -> None:
        """Close the producer. Nothing of value can be pending: every batch was flushed
        before its rows were marked, so this waits 2 s at most (records still buffered
        belong to unmarked rows, which are published again)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            _close(producer, min(self.flush_timeout, 2.0))

    # -- internals -------------------------------------------------------------------------

    def _get_producer(self) -> Any:
        if self._producer is None:
            self._producer = KafkaProducer(**self.config)
        return self._producer

    def _classify(self, error: BaseException | None) -> PublishResult:
        text = _describe(error)
        if isinstance(error, _FATAL_PRODUCER_ERRORS):
            log.warning("Kafka producer in a failed state; recreating it", extra={"error": text})
            producer, self._producer = self._producer, None
            if producer is not None:
                _close(producer, 0)
            return PublishResult.unavailable(text)
        if isinstance(error, _RECORD_ERRORS):
            return PublishResult.rejected(text)
        if isinstance(error, kafka_errors.KafkaError) and not error.retriable:
            # A broker response error that is not retriable concerns this record's batch.
            return PublishResult.rejected(text)
        return PublishResult.unavailable(text)

    def _metadata_failure(self, topic: str, error: BaseException) -> PublishResult:
        if time.monotonic() - self._last_ack < _REACHABLE_FOR:
            return PublishResult.rejected(f"unknown or unavailable topic {topic!r}: {error}")
        return PublishResult.unavailable(_describe(error))


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    return f"{type(error).__name__}: {error}"


def _close(producer: Any, timeout: float) -> None:
    try:
        producer.close(timeout=timeout)
    except Exception as error:  # pending records could not be flushed: drop them
        log.debug("Kafka producer closed with pending records", extra={"error": str(error)})
