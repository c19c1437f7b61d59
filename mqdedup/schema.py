"""The framework's tables, as SQLAlchemy ``MetaData`` users can add to their migrations.

Every table name starts with a configurable prefix (default ``mqdedup_``)::

    from mqdedup.schema import schema
    target_metadata = [Base.metadata, schema().metadata]   # alembic env.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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
from sqlalchemy.dialects.mysql import DATETIME as MYSQL_DATETIME
from sqlalchemy.dialects.postgresql import JSONB

from mqdedup.errors import ConfigurationError

DEFAULT_PREFIX = "mqdedup_"
SCHEMA_VERSION = 1
_PREFIX_PATTERN = re.compile(r"^[a-z_][a-z0-9_]{0,30}$")

JSONType = JSON().with_variant(JSONB(), "postgresql")
# Timestamps with microseconds on MySQL/MariaDB too (plain DATETIME there keeps seconds).
PreciseDateTime = DateTime(timezone=True).with_variant(MYSQL_DATETIME(fsp=6), "mysql", "mariadb")
# MySQL/MariaDB: keys compare byte for byte. The servers' default collations are
# case- and accent-insensitive, which would make ids "A-1" and "a-1" one dedup key.
MYSQL_TABLE_OPTIONS: dict[str, Any] = {"mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


@dataclass(frozen=True)
class Schema:
    """The tables of one prefix."""

    prefix: str
    metadata: MetaData
    processed: Table
    attempts: Table
    tokens: Table


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
        **MYSQL_TABLE_OPTIONS,
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
        **MYSQL_TABLE_OPTIONS,
    )
    # One-time tokens (mqdedup.dedup.tokens). Only a SHA-256 of each token is stored;
    # used tokens stay (used_at set) until purged, so a replay reads "already used".
    tokens = Table(
        f"{prefix}tokens",
        metadata,
        Column("token_hash", String(64), nullable=False),
        Column("owner", String(255), nullable=False),
        Column("issued_at", PreciseDateTime, nullable=False),
        Column("expires_at", PreciseDateTime, nullable=False),
        Column("used_at", PreciseDateTime, nullable=True),
        PrimaryKeyConstraint("token_hash", name=f"{prefix}tokens_pk"),
        Index(f"{prefix}tokens_expires_idx", "expires_at"),
        **MYSQL_TABLE_OPTIONS,
    )
    return Schema(
        prefix=prefix, metadata=metadata, processed=processed, attempts=attempts, tokens=tokens
    )
