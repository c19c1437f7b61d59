"""What the Kafka transport, lag and replay need from a consumer class, resolved once.

:meth:`mqdedup.kafka.consumer.KafkaConsumer.kafka_settings` builds it; the modules that
use it import it from here, so none of them imports the consumer (no cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Replaced by the source topic in ``dead_letter_topic`` (default ``{topic}.DLT``).
TOPIC_PLACEHOLDER = "{topic}"


@dataclass(frozen=True)
class KafkaSettings:
    """Everything the Kafka transport needs, resolved from a consumer class."""

    consumer_name: str
    group_id: str
    topics: tuple[str, ...]
    pattern: str | None
    bootstrap_servers: tuple[str, ...]
    consumer_config: Mapping[str, Any]
    producer_config: Mapping[str, Any]
    admin_config: Mapping[str, Any]
    dead_letter_topic: str
    create_dead_letter_topics: bool
    commit_timeout: float
    commit_interval: float
    dead_letter_timeout: float
    max_buffered: int
    #: Offsets stored in ``<table_prefix>kafka_offsets`` with each batch's effects.
    offsets_in_database: bool = False
    table_prefix: str = "mqdedup_"
    #: With offsets in the database: whether message ids are claimed too (the id
    #: strategy names a producer id rather than the record's coordinates).
    claims_with_offsets: bool = True

    def dead_letter_topic_for(self, topic: str) -> str:
        """The dead-letter topic of records read from ``topic``."""
        return self.dead_letter_topic.replace(TOPIC_PLACEHOLDER, topic)
