"""Names shared by the claim-call examples (FastStream and the kafka-python loop).

Read from the environment, like :mod:`examples.settings`, so the app, the producer and
the report started with the same environment agree:

* ``CLAIM_BROKER`` — ``kafka`` (default) or ``rabbit`` (the FastStream app; the loop is
  Kafka only);
* ``CLAIM_TOPIC`` / ``CLAIM_QUEUE`` / ``CLAIM_GROUP`` — the Kafka topic, the RabbitMQ
  queue and the Kafka consumer group (default ``claim-payments`` each);
* ``CLAIM_CONSUMER`` — the consumer name, the dedup scope (default ``claim-payments``);
* ``CLAIM_KAFKA_SESSION_TIMEOUT_MS`` — the Kafka group's session timeout (default 10000);
* ``CLAIM_CRASH_AFTER_COMMIT`` — a message id: the process kills itself (SIGKILL)
  right after that message's transaction commits, before the ack (the crash tests).
"""

from __future__ import annotations

import logging
import os
import signal

from sqlalchemy import Column, Integer, MetaData, String, Table

from examples import settings

log = logging.getLogger("examples.claim")


def broker_kind() -> str:
    """``kafka`` or ``rabbit``."""
    kind = os.environ.get("CLAIM_BROKER", "kafka")
    if kind not in ("kafka", "rabbit"):
        raise SystemExit(f"CLAIM_BROKER must be 'kafka' or 'rabbit', not {kind!r}")
    return kind


def topic() -> str:
    """The Kafka topic."""
    return os.environ.get("CLAIM_TOPIC", "claim-payments")


def queue() -> str:
    """The RabbitMQ queue."""
    return os.environ.get("CLAIM_QUEUE", "claim-payments")


def group() -> str:
    """The Kafka consumer group."""
    return os.environ.get("CLAIM_GROUP", "claim-payments")


def consumer_name() -> str:
    """The dedup scope passed to ``claim(..., consumer=...)``."""
    return os.environ.get("CLAIM_CONSUMER", "claim-payments")


def session_timeout_ms() -> int:
    """The Kafka group's session timeout: how long a killed member holds its partitions."""
    return int(os.environ.get("CLAIM_KAFKA_SESSION_TIMEOUT_MS", "10000"))


def payments_table() -> Table:
    """``<EXAMPLE_TABLE_PREFIX>claim_payments``: one row per charge.

    Deliberately no unique constraint on ``message_id``: only the claim keeps a
    redelivered message from charging twice.
    """
    return Table(
        f"{settings.business_prefix()}claim_payments",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("amount", Integer, nullable=False),
    )


def crash_point(message_id: str) -> None:
    """Die like ``kill -9`` after ``message_id``'s commit, before its ack (tests only)."""
    if os.environ.get("CLAIM_CRASH_AFTER_COMMIT") == message_id:
        log.warning("crash point: killing the process after the commit of %s", message_id)
        os.kill(os.getpid(), signal.SIGKILL)
