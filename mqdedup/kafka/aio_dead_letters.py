"""Kafka dead letters from the aiokafka transport: the original record plus ``x-mqdedup-*``
headers, acknowledged by the broker (``acks=all``) before the delivery is settled.

The same records as the kafka-python transport's
(:mod:`mqdedup.kafka.dead_letters`): original key, value and headers, the reason and
the source coordinates (:func:`~mqdedup.kafka.records.dead_letter_headers`), to
``{topic}.DLT`` by default. A missing dead-letter topic is created once (same partition
count and replication as its source) when allowed. Coroutines only: the transport awaits
them through the greenlet bridge.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiokafka  # type: ignore[import-untyped]
import aiokafka.errors as aio_errors  # type: ignore[import-untyped]
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]

from mqdedup.consumers.transport import DeadLetter
from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.kafka.aio_settings import AioKafkaSettings
from mqdedup.kafka.records import KafkaToken, dead_letter_headers, describe_error

log = logging.getLogger(__name__)

#: Errors that are the record's own fault: sending the same bytes again cannot succeed.
REFUSAL_ERRORS: tuple[type[BaseException], ...] = (
    aio_errors.MessageSizeTooLargeError,
    aio_errors.RecordTooLargeError,
    aio_errors.InvalidTopicError,
    aio_errors.TopicAuthorizationFailedError,
    aio_errors.PolicyViolationError,
    aio_errors.CorruptRecordException,
    ValueError,
    TypeError,
)
#: Longest wait (seconds) for the admin client's answers about dead-letter topics.
ADMIN_TIMEOUT = 10.0


class AioKafkaDeadLetters:
    """The dead-letter producer of one aiokafka consumer (started on first use)."""

    def __init__(self, settings: AioKafkaSettings) -> None:
        self.settings = settings
        self._producer: Any = None
        self._known_topics: set[str] = set()
        #: Why a dead-letter topic found missing could not be created (by topic).
        self._missing_topics: dict[str, str] = {}

    async def publish(self, token: KafkaToken, record: DeadLetter) -> None:
        """Publish the original record with ``record``'s headers; wait for the broker's ack.

        Raises :class:`DeadLetterRefusedError` when the broker refuses this record for
        good, :class:`BrokerUnavailableError` when it cannot be reached or does not answer
        within ``dead_letter_timeout`` (the delivery then stays unsettled).
        """
        base = self.settings.base
        topic = base.dead_letter_topic_for(token.partition[0])
        await self._ensure_topic(topic, token.partition[0])
        source = f"{token.partition[0]}/{token.partition[1]}/{token.offset}"
        try:
            producer = await self._started_producer()
            await asyncio.wait_for(
                producer.send_and_wait(
                    topic,
                    value=token.record.value,
                    key=token.record.key,
                    headers=dead_letter_headers(token, record),
                ),
                base.dead_letter_timeout,
            )
        except REFUSAL_ERRORS as error:
            await self._reset()  # an idempotent producer may not survive a refused record
            self._refused(topic, source, describe_error(error))
        except (aio_errors.KafkaError, TimeoutError, OSError) as error:
            await self._reset()
            if await self._topic_exists(topic) is False:
                why = self._missing_topics.get(topic) or "it could not be created"
                self._refused(
                    topic,
                    source,
                    f"the topic does not exist and the broker does not create it ({why})",
                )
            raise BrokerUnavailableError(
                f"dead-letter publish to {topic!r} failed: {describe_error(error)}"
            ) from error
        log.info(
            "published to dead-letter topic",
            extra={
                "consumer": self.settings.consumer_name,
                "topic": topic,
                "source": source,
                "reason": record.reason,
            },
        )

    async def close(self) -> None:
        """Flush and stop the producer (if it was started)."""
        await self._reset()

    # -- internals -------------------------------------------------------------------------

    def _refused(self, topic: str, source: str, error: str) -> None:
        log.warning(
            "the broker refused the dead letter",
            extra={
                "consumer": self.settings.consumer_name,
                "topic": topic,
                "source": source,
                "error": error,
            },
        )
        raise DeadLetterRefusedError(f"the broker refused the dead letter for {topic!r}: {error}")

    async def _started_producer(self) -> Any:
        if self._producer is None:
            producer = aiokafka.AIOKafkaProducer(**self.settings.producer)
            try:
                await asyncio.wait_for(producer.start(), self.settings.connect_timeout)
            except BaseException:
                await _quietly(producer.stop())
                raise
            self._producer = producer
        return self._producer

    async def _reset(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _quietly(producer.stop())

    async def _ensure_topic(self, topic: str, source_topic: str) -> None:
        """Check once that the dead-letter topic exists; create it if missing (when allowed).

        Not fatal when it fails: the broker may auto-create the topic, or the publish
        finds out.
        """
        if topic in self._known_topics:
            return
        base = self.settings.base
        try:
            async with _admin(self.settings) as admin:
                if topic in set(await admin.list_topics()):
                    self._known(topic)
                    return
                if not base.create_dead_letter_topics:
                    self._missing_topics[topic] = "create_dead_letter_topics is off"
                    return
                partitions, replication = _shape(await admin.describe_topics([source_topic]))
                answer = await admin.create_topics(
                    [NewTopic(topic, partitions, replication)],
                    timeout_ms=int(ADMIN_TIMEOUT * 1000),
                )
                problem = _create_error(answer)
                if problem is None:
                    log.info(
                        "created dead-letter topic",
                        extra={"consumer": self.settings.consumer_name, "topic": topic},
                    )
                    self._known(topic)
                    return
                self._missing_topics[topic] = f"creating it failed: {problem}"
                log.warning(
                    "could not create the dead-letter topic",
                    extra={
                        "consumer": self.settings.consumer_name,
                        "topic": topic,
                        "error": problem,
                    },
                )
        except (aio_errors.KafkaError, TimeoutError, OSError) as error:
            log.warning(
                "could not check/create the dead-letter topic",
                extra={
                    "consumer": self.settings.consumer_name,
                    "topic": topic,
                    "error": describe_error(error),
                },
            )

    def _known(self, topic: str) -> None:
        self._known_topics.add(topic)
        self._missing_topics.pop(topic, None)

    async def _topic_exists(self, topic: str) -> bool | None:
        """Whether ``topic`` exists (None: the cluster did not answer)."""
        try:
            async with _admin(self.settings) as admin:
                found = topic in set(await admin.list_topics())
        except (aio_errors.KafkaError, TimeoutError, OSError):
            return None
        if found:
            self._known(topic)
        return found


class _admin:  # noqa: N801 - used like a function: ``async with _admin(settings)``
    """A started admin client for one question, stopped afterwards."""

    def __init__(self, settings: AioKafkaSettings) -> None:
        self._client = AIOKafkaAdminClient(**settings.admin)

    async def __aenter__(self) -> Any:
        await asyncio.wait_for(self._client.start(), ADMIN_TIMEOUT)
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        await _quietly(self._client.close())


def _shape(described: Any) -> tuple[int, int]:
    """``(partitions, replication factor)`` of a described topic (``(1, 1)`` if unknown)."""
    for entry in described or ():
        partitions = entry.get("partitions") or []
        if partitions:
            return len(partitions), max(1, len(partitions[0].get("replicas") or [0]))
    return 1, 1


def _create_error(answer: Any) -> str | None:
    """The error of a ``create_topics`` answer (None: created or already there)."""
    for entry in getattr(answer, "topic_errors", None) or ():
        code = int(entry[1] or 0)
        if code in (0, aio_errors.TopicAlreadyExistsError.errno):
            continue
        message = entry[2] if len(entry) > 2 else None
        name = str(aio_errors.for_code(code).__name__)
        return name + (f": {message}" if message else "")
    return None


async def _quietly(awaitable: Any) -> None:
    """Await a client's stop/close; a failure there only gets logged."""
    try:
        await asyncio.wait_for(awaitable, ADMIN_TIMEOUT)
    except Exception as error:
        log.debug("ignoring an error while stopping a Kafka client: %s", describe_error(error))
