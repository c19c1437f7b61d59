"""Where the examples run: read from the same environment variables as the ``mqdedup`` CLI.

* ``MQDEDUP_DATABASE_URL`` — the database (default: the local PostgreSQL of
  ``scripts/services.sh`` / ``docker compose``);
* ``MQDEDUP_TABLE_PREFIX`` — prefix of mqdedup's own tables (default ``mqdedup_``);
* ``EXAMPLE_TABLE_PREFIX`` — prefix of the examples' business tables (default ``example_``);
* ``MQDEDUP_KAFKA_BOOTSTRAP`` / ``MQDEDUP_RABBITMQ_URL`` — the brokers.

The consumer classes read them at import time, so a ``mqdedup worker`` process and the
producer / report scripts started with the same environment agree on every name.
"""

from __future__ import annotations

import os

from sqlalchemy import Engine

from mqdedup import create_engine

DEFAULT_DATABASE_URL = "postgresql+psycopg://mqdedup:mqdedup@127.0.0.1:5432/mqdedup"


def database_url() -> str:
    """The database the examples write to."""
    return os.environ.get("MQDEDUP_DATABASE_URL", DEFAULT_DATABASE_URL)


def engine() -> Engine:
    """An engine on :func:`database_url`."""
    return create_engine(database_url())


def mqdedup_prefix() -> str:
    """Prefix of mqdedup's tables (the dedup table, the outbox), as the CLI uses it."""
    return os.environ.get("MQDEDUP_TABLE_PREFIX", "mqdedup_")


def business_prefix() -> str:
    """Prefix of the examples' own tables."""
    return os.environ.get("EXAMPLE_TABLE_PREFIX", "example_")


def kafka_bootstrap() -> str:
    """Kafka bootstrap servers."""
    return os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


def rabbitmq_url() -> str:
    """RabbitMQ URL."""
    return os.environ.get("MQDEDUP_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
