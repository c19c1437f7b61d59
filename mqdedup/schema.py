"""The framework's tables, as SQLAlchemy ``MetaData`` users can add to their migrations.

Every table name starts with a configurable prefix (default ``mqdedup_``)::

    from mqdedup.schema import schema
    target_metadata = [Base.metadata, schema().metadata]   # alembic env.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB

from mqdedup.errors import ConfigurationError

DEFAULT_PREFIX = "mqdedup_"
SCHEMA_VERSION = 1
_PREFIX_PATTERN = re.compile(r"^[a-z_][a-z0-9_]{0,30}$")

JSONType = JSON().with_variant(JSONB(), "postgresql")


@dataclass(frozen=True)
class Schema:
    """The tables of one prefix."""

    prefix: str
    metadata: MetaData
    processed: Table
    attempts: Table


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a safe SQL identifier prefix, else raise."""
    if not _PREFIX_PATTERN.match(prefix):
        raise ConfigurationError(
            f"table prefix {prefix!r} must be lower-case letters, digits and underscores"
        )
    return prefix


@lru_cache(maxsize=16)
def schema(prefix: str = DEFAULT_PREFIX) -> Schema:
    """The framework's tables for ``prefix`` (built once per prefix)."""
    validate_prefix(prefix)
    metadata = MetaData()
    processed = Table(
        f"{prefix}processed_messages",
        metadata,
        Column("consumer_name", String(255), nullable=False),
        Column("message_id", String(255), nullable=False),
        Column("processed_at", DateTime(timezone=True), nullable=False),
        Column("result", JSONType, nullable=True),
        PrimaryKeyConstraint("consumer_name", "message_id", name=f"{prefix}processed_pk"),
        Index(f"{prefix}processed_at_idx", "processed_at"),
    )
    attempts = Table(
        f"{prefix}message_attempts",
        metadata,
        Column("consumer_name", String(255), nullable=False),
        Column("message_id", String(255), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("last_error", Text, nullable=True),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        PrimaryKeyConstraint("consumer_name", "message_id", name=f"{prefix}attempts_pk"),
        Index(f"{prefix}attempts_updated_idx", "updated_at"),
    )
    return Schema(prefix=prefix, metadata=metadata, processed=processed, attempts=attempts)
