"""Dead letters wherever they are kept: the database, Kafka dead-letter topics, RabbitMQ
dead-letter queues.

One record type (:class:`DeadLetterRecord`), one protocol (:class:`DeadLetterPlace`) and
one place per module: :class:`~mqdedup.deadletters.database.DatabaseDeadLetters` here,
:class:`mqdedup.kafka.dead_letter_topic.KafkaDeadLetterTopics` and
:class:`mqdedup.rabbitmq.dead_letter_queue.RabbitDeadLetterQueues` in the broker adapters
(the only importers of their client libraries). :func:`group` groups records by consumer
and error; :func:`replay` runs a consumer over chosen dead letters through its claims.
``mqdedup dead-letters`` and ``mqdedup console`` are built on this package.
"""

from mqdedup.deadletters.database import DatabaseDeadLetters
from mqdedup.deadletters.records import (
    BODY_LIMIT,
    PLACES,
    BodyPreview,
    DeadLetterKeyError,
    DeadLetterPlace,
    DeadLetterRecord,
    Place,
    body_preview,
    error_key,
    group,
)
from mqdedup.deadletters.replay import RecordTransport, ReplayOutcome, replay

__all__ = [
    "BODY_LIMIT",
    "PLACES",
    "BodyPreview",
    "DatabaseDeadLetters",
    "DeadLetterKeyError",
    "DeadLetterPlace",
    "DeadLetterRecord",
    "Place",
    "RecordTransport",
    "ReplayOutcome",
    "body_preview",
    "error_key",
    "group",
    "replay",
]
