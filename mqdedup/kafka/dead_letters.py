"""Kafka dead letters: the original record plus ``x-mqdedup-*`` headers, acknowledged.

:class:`KafkaDeadLetters` publishes a dead letter to the consumer's dead-letter topic
(``{topic}.DLT`` by default) with its original key, value and headers, through an
idempotent ``acks=all`` producer, and returns only once the broker acknowledged it. A
missing topic is created once (same partition count as its source) when allowed. It
never touches the kafka-python consumer, so the worker thread may call it while the
transport's poll thread polls; the admin client answers the topic questions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import kafka.errors as kafka_errors

from mqdedup.consumers.transport import DeadLetter
from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.kafka.producer import (
    ProducerRecord,
    RecoveringProducer,
    SendOutcome,
    Sent,
    admin_for,
    topic_exists,
)
from mqdedup.kafka.records import KafkaToken, dead_letter_headers, describe_error

if TYPE_CHECKING:
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)


class KafkaDeadLetters:
    """The dead-letter producer of one consumer, and what it knows about its topics."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._producer = RecoveringProducer(
            settings.producer_config, name=f"{settings.consumer_name} dead letters"
        )
        self._known_topics: set[str] = set()
        #: Why a dead-letter topic found missing could not be created (by topic).
        self._missing_topics: dict[str, str] = {}

    def close(self, timeout: float) -> None:
        """Flush and close the producer."""
        self._producer.close(timeout)

    def publish(self, token: KafkaToken, record: DeadLetter) -> None:
        """Publish the original record with ``record``'s headers; wait for the broker's ack.

        Raises :class:`DeadLetterRefusedError` when the broker refuses this record for
        good (the reason names the topic and the broker's error), and
        :class:`BrokerUnavailableError` when it cannot be reached or does not answer
        within the dead-letter timeout (the delivery stays unsettled: the offset does
        not move past it, and it is given back).
        """
        topic = self.settings.dead_letter_topic_for(token.partition[0])
        self._ensure_dead_letter_topic(topic, token.partition[0])
        outgoing = ProducerRecord(
            topic, token.record.key, token.record.value, dead_letter_headers(token, record)
        )
        sent = self._producer.send_all([outgoing], self.settings.dead_letter_timeout)[0]
        if sent.outcome is SendOutcome.NO_METADATA:
            sent = self._no_metadata(topic, sent)
        source = f"{token.partition[0]}/{token.partition[1]}/{token.offset}"
        if sent.outcome is SendOutcome.REFUSED:
            log.warning(
                "the broker refused the dead letter",
                extra={
                    "consumer": self.settings.consumer_name,
                    "topic": topic,
                    "source": source,
                    "error": sent.error,
                },
            )
            raise DeadLetterRefusedError(
                f"the broker refused the dead letter for {topic!r}: {sent.error}"
            )
        if not sent.ok:
            raise BrokerUnavailableError(f"dead-letter publish to {topic!r} failed: {sent.error}")
        log.info(
            "published to dead-letter topic",
            extra={
                "consumer": self.settings.consumer_name,
                "topic": topic,
                "source": source,
                "reason": record.reason,
            },
        )

    def _no_metadata(self, topic: str, sent: Sent) -> Sent:
        """The dead-letter topic's metadata did not arrive: missing topic, or an outage?"""
        exists = self._topic_exists(topic)
        if exists is False:
            why = self._missing_topics.get(topic) or (
                "create_dead_letter_topics is off"
                if not self.settings.create_dead_letter_topics
                else "it could not be created"
            )
            return Sent(
                SendOutcome.REFUSED,
                f"the topic does not exist and the broker does not create it ({why})",
            )
        return Sent(SendOutcome.UNAVAILABLE, sent.error)

    def _ensure_dead_letter_topic(self, topic: str, source_topic: str) -> None:
        """Check once that the dead-letter topic exists; create it if missing (when allowed).

        Not fatal when it fails: the broker may auto-create the topic, or the publish
        finds out (see :meth:`_no_metadata`).
        """
        if topic in self._known_topics:
            return
        try:
            with admin_for(self.settings.admin_config) as admin:
                if topic in set(admin.list_topics()):
                    self._known_topics.add(topic)
                    self._missing_topics.pop(topic, None)
                    return
                if not self.settings.create_dead_letter_topics:
                    self._missing_topics[topic] = "create_dead_letter_topics is off"
                    return
                partitions = _partition_count(admin, source_topic)
                answer = admin.create_topics(
                    {topic: {"num_partitions": partitions}},
                    timeout_ms=int(self.settings.dead_letter_timeout * 1000),
                    raise_errors=False,
                )
                problem = _create_error(answer)
                if problem is None:
                    log.info(
                        "created dead-letter topic",
                        extra={"consumer": self.settings.consumer_name, "topic": topic},
                    )
                    self._known_topics.add(topic)
                    self._missing_topics.pop(topic, None)
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
        except Exception as error:
            log.warning(
                "could not check/create the dead-letter topic",
                extra={
                    "consumer": self.settings.consumer_name,
                    "topic": topic,
                    "error": describe_error(error),
                },
            )

    def _topic_exists(self, topic: str) -> bool | None:
        """Whether ``topic`` exists (None: the cluster did not answer)."""
        found = topic_exists(self.settings.admin_config, topic, self.settings.consumer_name)
        if found:
            self._known_topics.add(topic)
        return found


def _partition_count(admin: Any, topic: str) -> int:
    """How many partitions ``topic`` has (1 if unknown); asked through the admin client,
    never the consumer (this runs on the worker thread)."""
    described = admin.describe_topics([topic])
    for entry in described or ():
        if entry.get("name") == topic and entry.get("partitions"):
            return len(entry["partitions"])
    return 1


def _create_error(answer: Any) -> str | None:
    """The error of a ``create_topics`` answer for one topic (None: created or existing)."""
    topics = answer.get("topics", []) if isinstance(answer, dict) else []
    for entry in topics:
        code = int(entry.get("error_code", 0) or 0)
        if code in (0, kafka_errors.TopicAlreadyExistsError.errno):
            continue
        error_type = kafka_errors.for_code(code)
        message = entry.get("error_message")
        return f"{error_type.__name__}" + (f": {message}" if message else "")
    return None
