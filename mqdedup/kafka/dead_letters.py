"""Publishing Kafka dead letters: the original record plus the ``x-mqdedup-*`` headers.

:class:`KafkaDeadLetters` is what a transport's ``dead_letter`` does: it makes sure the
dead-letter topic exists (creating it when allowed), publishes the original key, value
and headers plus the dead-letter headers, and waits for the broker's acknowledgement
(``acks=all``, idempotent producer) before it returns. A record the broker refuses for
good raises :class:`~mqdedup.errors.DeadLetterRefusedError` with the broker's reason;
an outage raises :class:`~mqdedup.errors.BrokerUnavailableError`. The producer is
replaced when it goes fatal (:mod:`mqdedup.kafka.producer`), so one refused record
never blocks later ones.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import kafka
import kafka.errors as kafka_errors

from mqdedup.consumers.transport import DeadLetter
from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.kafka.producer import Outcome, ProducerRecord, RecoveringProducer, Sent
from mqdedup.kafka.transport import KafkaToken, dead_letter_headers

if TYPE_CHECKING:
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)


class KafkaDeadLetters:
    """Publishes dead letters of one consumer to its dead-letter topic(s).

    ``partitions_of(topic)`` gives the partition count of a source topic: a dead-letter
    topic created here gets as many.
    """

    def __init__(self, settings: KafkaSettings, partitions_of: Callable[[str], int]) -> None:
        self.settings = settings
        self._partitions_of = partitions_of
        self._producer = RecoveringProducer(
            settings.producer_config, name=f"{settings.consumer_name} dead letters"
        )
        self._known: set[str] = set()
        #: Why a dead-letter topic found missing could not be created (by topic).
        self._missing: dict[str, str] = {}

    def publish(self, token: KafkaToken, record: DeadLetter) -> None:
        """Publish the record ``token`` names with ``record``'s headers; wait for the ack."""
        topic = self.settings.dead_letter_topic_for(token.partition[0])
        self._ensure_topic(topic, token.partition[0])
        outgoing = ProducerRecord(
            topic, token.record.key, token.record.value, dead_letter_headers(token, record)
        )
        sent = self._producer.send_all([outgoing], self.settings.dead_letter_timeout)[0]
        if sent.outcome is Outcome.NO_METADATA:
            sent = self._no_metadata(topic, sent)
        source = f"{token.partition[0]}/{token.partition[1]}/{token.offset}"
        if sent.outcome is Outcome.REFUSED:
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

    def close(self, timeout: float = 10.0) -> None:
        """Flush and close the producer."""
        self._producer.close(timeout)

    def _no_metadata(self, topic: str, sent: Sent) -> Sent:
        """The dead-letter topic's metadata did not arrive: missing topic, or an outage?"""
        if self._topic_exists(topic) is False:
            why = self._missing.get(topic) or (
                "create_dead_letter_topics is off"
                if not self.settings.create_dead_letter_topics
                else "it could not be created"
            )
            return Sent(
                Outcome.REFUSED,
                f"the topic does not exist and the broker does not create it ({why})",
            )
        return Sent(Outcome.UNAVAILABLE, sent.error)

    def _ensure_topic(self, topic: str, source_topic: str) -> None:
        """Check once that the dead-letter topic exists; create it if missing (when allowed).

        Not fatal when it fails: the broker may auto-create the topic, or the publish
        finds out (see :meth:`_no_metadata`).
        """
        if topic in self._known:
            return
        name = self.settings.consumer_name
        try:
            with self._admin() as admin:
                if topic in set(admin.list_topics()):
                    self._known.add(topic)
                    self._missing.pop(topic, None)
                    return
                if not self.settings.create_dead_letter_topics:
                    self._missing[topic] = "create_dead_letter_topics is off"
                    return
                answer = admin.create_topics(
                    {topic: {"num_partitions": self._partitions_of(source_topic) or 1}},
                    timeout_ms=int(self.settings.dead_letter_timeout * 1000),
                    raise_errors=False,
                )
                problem = _create_error(answer)
                if problem is None:
                    log.info("created dead-letter topic", extra={"consumer": name, "topic": topic})
                    self._known.add(topic)
                    self._missing.pop(topic, None)
                    return
                self._missing[topic] = f"creating it failed: {problem}"
                log.warning(
                    "could not create the dead-letter topic",
                    extra={"consumer": name, "topic": topic, "error": problem},
                )
        except Exception as error:
            log.warning(
                "could not check/create the dead-letter topic",
                extra={"consumer": name, "topic": topic, "error": _describe(error)},
            )

    def _topic_exists(self, topic: str) -> bool | None:
        """Whether ``topic`` exists (None: the cluster did not answer)."""
        try:
            with self._admin() as admin:
                found = topic in set(admin.list_topics())
        except Exception as error:
            log.warning(
                "could not list topics",
                extra={"consumer": self.settings.consumer_name, "error": _describe(error)},
            )
            return None
        if found:
            self._known.add(topic)
        return found

    @contextlib.contextmanager
    def _admin(self) -> Iterator[Any]:
        admin = kafka.KafkaAdminClient(**self.settings.admin_config)
        try:
            yield admin
        finally:
            try:
                admin.close()
            except Exception:
                log.debug("admin client close failed", exc_info=True)


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


def _describe(error: BaseException) -> str:
    """``ClassName: first line`` of an error (kafka-python errors never carry secrets)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
