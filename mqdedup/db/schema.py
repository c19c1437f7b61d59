"""The framework's tables, as SQLAlchemy ``MetaData`` users can add to their migrations.

Every table name starts with a configurable prefix (default ``mqdedup_``)::

    from mqdedup.db.schema import schema
    target_metadata = [Base.metadata, schema().metadata]   # alembic env.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.mysql import DATETIME as MYSQL_DATETIME
from sqlalchemy.dialects.mysql import LONGBLOB as MYSQL_LONGBLOB
from sqlalchemy.dialects.mysql import VARBINARY as MYSQL_VARBINARY
from sqlalchemy.dialects.mysql import VARCHAR as MYSQL_VARCHAR
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator, TypeEngine

from mqdedup.errors import ConfigurationError

DEFAULT_PREFIX = "mqdedup_"
SCHEMA_VERSION = 6
_PREFIX_PATTERN = re.compile(r"^[a-z_][a-z0-9_]*$")
#: The longest identifier every supported database accepts: PostgreSQL's 63 bytes
#: (MySQL/MariaDB allow 64; SQLite has no limit). Longer PostgreSQL names are silently
#: truncated, so two of our names could collide.
MAX_IDENTIFIER_BYTES = 63

JSONType = JSON().with_variant(JSONB(), "postgresql")
# Timestamps with microseconds on MySQL/MariaDB too (plain DATETIME there keeps seconds).
PreciseDateTime = DateTime(timezone=True).with_variant(MYSQL_DATETIME(fsp=6), "mysql", "mariadb")
# MySQL/MariaDB: utf8mb4 and byte-wise comparison. The servers' default collations are
# case- and accent-insensitive, which would make ids "A-1" and "a-1" one dedup key.
# (``mariadb_`` options apply with ``mariadb://`` URLs, ``mysql_`` ones with ``mysql://``.)
MYSQL_TABLE_OPTIONS: dict[str, Any] = {
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mariadb_charset": "utf8mb4",
    "mariadb_collate": "utf8mb4_bin",
}


#: ``Index.info`` key: the databases an index is created on (see :func:`only_on`).
INDEX_DIALECTS = "mqdedup_dialects"

# Dialect names for ``Index.ddl_if`` (it takes a tuple; its annotation says ``str``).
_PARTIAL_INDEX_DIALECTS: Any = ("postgresql", "sqlite")
_MYSQL_DIALECTS: Any = ("mysql", "mariadb")
_BTREE_RETENTION_DIALECTS: Any = ("mysql", "mariadb", "sqlite")


def only_on(index: Index, dialects: Any) -> Index:
    """``index``, created on ``dialects`` only (``Index.ddl_if``), which it also records
    in its public ``info`` (``INDEX_DIALECTS``) for the tools that must know, such as the
    Alembic hook (:func:`mqdedup.db.alembic_support.include_object`)."""
    index.info[INDEX_DIALECTS] = (dialects,) if isinstance(dialects, str) else tuple(dialects)
    return index.ddl_if(dialect=dialects)


class KeyString(TypeDecorator[str]):
    """A VARCHAR key column compared exactly, byte for byte, on every database.

    PostgreSQL and SQLite compare text exactly already. On MySQL/MariaDB even the
    ``*_bin`` collations are PAD SPACE (``'id'`` equals ``'id '``), so key columns get
    the server's binary NO PAD collation, chosen when the table is created:
    ``utf8mb4_nopad_bin`` (MariaDB >= 10.2) or ``utf8mb4_0900_bin`` (MySQL >= 8.0.17).
    Older servers have none and keep ``utf8mb4_bin`` (ids differing only by trailing
    spaces then collide there).
    """

    impl = String
    cache_ok = True

    def __init__(self, length: int = 255) -> None:
        super().__init__(length)
        self.length = length

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(
                MYSQL_VARCHAR(
                    self.length, charset="utf8mb4", collation=_mysql_key_collation(dialect)
                )
            )
        return dialect.type_descriptor(String(self.length))


def _mysql_key_collation(dialect: Dialect) -> str:
    version = tuple(getattr(dialect, "server_version_info", None) or ())
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
    return "utf8mb4_0900_bin" if version >= (8, 0, 17) else "utf8mb4_bin"


@dataclass(frozen=True)
class Schema:
    """The tables of one prefix."""

    prefix: str
    metadata: MetaData
    processed: Table
    attempts: Table
    tokens: Table
    outbox: Table
    outbox_leases: Table
    outbox_counts: Table
    retention: Table
    dead_letters: Table
    steps: Table
    locks: Table
    audit: Table
    handled_dead_letters: Table
    kafka_offsets: Table


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a safe SQL identifier prefix, else raise.

    The characters are checked here; :func:`schema` also checks that every table,
    index and constraint name derived from it fits :data:`MAX_IDENTIFIER_BYTES`.
    """
    if not isinstance(prefix, str) or not _PREFIX_PATTERN.match(prefix):
        raise ConfigurationError(
            f"table prefix {prefix!r} must be lower-case letters, digits and underscores "
            "(not starting with a digit)"
        )
    return prefix


def _check_identifier_lengths(prefix: str, metadata: MetaData) -> None:
    """Raise if a name built from ``prefix`` exceeds what the databases can hold."""
    names = [
        str(name)
        for table in metadata.tables.values()
        for name in (
            table.name,
            *(index.name for index in table.indexes),
            *(constraint.name for constraint in table.constraints),
            # PostgreSQL's names of an unnamed primary key and of a serial's sequence
            f"{table.name}_pkey" if table.primary_key.name is None else None,
            f"{table.name}_{table.autoincrement_column.name}_seq"
            if table.autoincrement_column is not None
            else None,
        )
        if name
    ]
    longest = max(names, key=lambda name: len(name.encode()))
    if len(longest.encode()) > MAX_IDENTIFIER_BYTES:
        room = MAX_IDENTIFIER_BYTES - (len(longest.encode()) - len(prefix.encode()))
        raise ConfigurationError(
            f"table prefix {prefix!r} is too long: it makes {longest!r} "
            f"({len(longest.encode())} characters; PostgreSQL names hold "
            f"{MAX_IDENTIFIER_BYTES}); use at most {room} characters"
        )


@lru_cache(maxsize=16)
def schema(prefix: str = DEFAULT_PREFIX) -> Schema:
    """The framework's tables for ``prefix`` (built once per prefix)."""
    validate_prefix(prefix)
    metadata = MetaData()
    processed = Table(
        f"{prefix}processed_messages",
        metadata,
        Column("consumer_name", KeyString(255), nullable=False),
        Column("message_id", KeyString(255), nullable=False),
        Column("processed_at", DateTime(timezone=True), nullable=False),
        Column("result", JSONType, nullable=True),
        PrimaryKeyConstraint("consumer_name", "message_id", name=f"{prefix}processed_pk"),
        *_retention_indexes(prefix),
        **MYSQL_TABLE_OPTIONS,
    )
    attempts = Table(
        f"{prefix}message_attempts",
        metadata,
        Column("consumer_name", KeyString(255), nullable=False),
        Column("message_id", KeyString(255), nullable=False),
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
        Column("owner", KeyString(255), nullable=False),
        Column("issued_at", PreciseDateTime, nullable=False),
        Column("expires_at", PreciseDateTime, nullable=False),
        Column("used_at", PreciseDateTime, nullable=True),
        PrimaryKeyConstraint("token_hash", name=f"{prefix}tokens_pk"),
        Index(f"{prefix}tokens_expires_idx", "expires_at"),
        **MYSQL_TABLE_OPTIONS,
    )
    outbox = _outbox_table(prefix, metadata)
    # One relay's lease on the batches it is publishing: the shards it claims from and
    # until when. Written with each claim, removed when its burst of batches is settled;
    # a relay taking over those shards waits until a dead relay's lease has expired.
    outbox_leases = Table(
        f"{prefix}outbox_leases",
        metadata,
        Column("relay_id", KeyString(255), nullable=False),
        #: The shards (``shard_hash % shards``) as comma-separated numbers; "0" unsharded.
        Column("shards", Text, nullable=False),
        Column("locked_until", PreciseDateTime, nullable=False),
        PrimaryKeyConstraint("relay_id", name=f"{prefix}outbox_leases_pk"),
        **MYSQL_TABLE_OPTIONS,
    )
    # Rows published and deleted (``delete_published``), counted per destination and
    # hour: what status reports as published, purged with the retention.
    outbox_counts = Table(
        f"{prefix}outbox_counts",
        metadata,
        Column("broker", KeyString(64), nullable=False),
        Column("destination", KeyString(255), nullable=False),
        Column("hour", PreciseDateTime, nullable=False),
        Column("published", BigInteger, nullable=False),
        PrimaryKeyConstraint("broker", "destination", "hour", name=f"{prefix}outbox_counts_pk"),
        **MYSQL_TABLE_OPTIONS,
    )
    # The dedup retention horizon: claims before ``purged_before`` may have been purged,
    # so a replay of older messages could apply them again (``*``: every consumer).
    retention = Table(
        f"{prefix}retention_horizons",
        metadata,
        Column("consumer_name", KeyString(255), primary_key=True),
        Column("purged_before", DateTime(timezone=True), nullable=False),
        Column("purged_at", DateTime(timezone=True), nullable=False),
        **MYSQL_TABLE_OPTIONS,
    )
    dead_letters = _dead_letters_table(prefix, metadata)
    steps = _steps_table(prefix, metadata)
    # Lease locks with fencing tokens (mqdedup.locks, PostgreSQL): one row per lock name,
    # never deleted, so its token only grows; ``owner`` NULL when released.
    locks = Table(
        f"{prefix}locks",
        metadata,
        Column("name", KeyString(255), nullable=False),
        Column("owner", String(64), nullable=True),
        Column("token", BigInteger, nullable=False),
        Column("expires_at", PreciseDateTime, nullable=False),
        PrimaryKeyConstraint("name", name=f"{prefix}locks_pk"),
        **MYSQL_TABLE_OPTIONS,
    )
    audit = _audit_table(prefix, metadata)
    # Dead letters in a Kafka dead-letter topic that were deleted, replayed or requeued
    # (mqdedup.deadletters.handled): a topic cannot drop one record, so they are marked.
    handled_dead_letters = Table(
        f"{prefix}handled_dead_letters",
        metadata,
        Column("place", KeyString(32), nullable=False),
        Column("dead_letter_key", KeyString(255), nullable=False),
        Column("action", String(32), nullable=False),
        Column("handled_at", PreciseDateTime, nullable=False),
        PrimaryKeyConstraint("place", "dead_letter_key", name=f"{prefix}handled_dl_pk"),
        **MYSQL_TABLE_OPTIONS,
    )
    # Kafka offsets stored in the business transaction (``offsets_in_database``): per
    # group and partition the next offset to process; ``owner_epoch`` is bumped by each
    # new owner on assignment and every write is conditional on it (zombies are fenced);
    # ``done_above``: offsets above ``next_offset`` committed while a record below them
    # was still being retried (comma-separated, usually NULL).
    kafka_offsets = Table(
        f"{prefix}kafka_offsets",
        metadata,
        Column("group_id", KeyString(255), nullable=False),
        Column("topic", KeyString(255), nullable=False),
        Column("partition", Integer, nullable=False),
        Column("next_offset", BigInteger, nullable=True),
        Column("owner_epoch", BigInteger, nullable=False),
        Column("done_above", Text, nullable=True),
        Column("updated_at", PreciseDateTime, nullable=False),
        PrimaryKeyConstraint("group_id", "topic", "partition", name=f"{prefix}kafka_offsets_pk"),
        **MYSQL_TABLE_OPTIONS,
    )
    _check_identifier_lengths(prefix, metadata)
    return Schema(
        prefix=prefix,
        metadata=metadata,
        processed=processed,
        attempts=attempts,
        tokens=tokens,
        outbox=outbox,
        outbox_leases=outbox_leases,
        outbox_counts=outbox_counts,
        retention=retention,
        dead_letters=dead_letters,
        steps=steps,
        locks=locks,
        audit=audit,
        handled_dead_letters=handled_dead_letters,
        kafka_offsets=kafka_offsets,
    )


def _retention_indexes(prefix: str) -> tuple[Index, Index]:
    """The dedup table's index on ``processed_at``, which only the retention purge reads.

    PostgreSQL (schema 3): a BRIN index. Claims append rows in ``processed_at`` order,
    so each block range's min/max summary is narrow and the purge's range predicate
    finds the old rows through it (a Bitmap Heap Scan). Unlike a btree it is not
    updated entry by entry, so a 500-id claim costs ~18% less
    (``bench/claim_index_bench.py``: 10.5 -> 8.6 ms, the same as with no second index).
    Once purges freed pages that new claims refill, ranges hold old and new rows and
    their summaries widen: the purge then reads the table instead (see
    ``DedupStore.purge``), still correct. ``autosummarize`` has autovacuum summarize
    each range as it fills. A range without a summary is always scanned, never
    skipped, so a purge right after a burst is correct either way; the summaries only
    decide how much of the table it reads.

    MySQL/MariaDB and SQLite have no BRIN: they keep a btree.
    """
    return (
        only_on(Index(f"{prefix}processed_at_idx", "processed_at"), _BTREE_RETENTION_DIALECTS),
        only_on(
            Index(
                f"{prefix}processed_at_brin",
                "processed_at",
                postgresql_using="brin",
                postgresql_with={"autosummarize": "on"},
            ),
            "postgresql",
        ),
    )


def _steps_table(prefix: str, metadata: MetaData) -> Table:
    """``<prefix>steps`` (schema 4): the recorded external calls of ``ctx.step``.

    One row per consumer, message id and step name, written in transactions of its own
    (not the message's): ``started`` when a run is about to call, ``done`` with the
    call's JSON ``result`` once it returned. Purged with the claims
    (``mqdedup dedup purge``), by ``started_at``. See :mod:`mqdedup.dedup.steps`.
    """
    return Table(
        f"{prefix}steps",
        metadata,
        Column("consumer_name", KeyString(255), nullable=False),
        Column("message_id", KeyString(255), nullable=False),
        Column("name", KeyString(200), nullable=False),
        Column("state", String(16), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("result", JSONType, nullable=True),
        Column("started_at", PreciseDateTime, nullable=False),
        Column("completed_at", PreciseDateTime, nullable=True),
        PrimaryKeyConstraint("consumer_name", "message_id", "name", name=f"{prefix}steps_pk"),
        Index(f"{prefix}steps_started_idx", "started_at"),
        **MYSQL_TABLE_OPTIONS,
    )


def _audit_table(prefix: str, metadata: MetaData) -> Table:
    """``<prefix>audit`` (schema 5): every action taken in ``mqdedup console``.

    One row per action: who (``actor``), what (``action`` and its ``target``), when
    (``at``), how many messages it touched and how it ended (``outcome``).
    """
    return Table(
        f"{prefix}audit",
        metadata,
        Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
        Column("at", PreciseDateTime, nullable=False),
        Column("actor", String(255), nullable=False),
        Column("action", String(64), nullable=False),
        Column("target", Text, nullable=False),
        Column("messages", Integer, nullable=False),
        Column("outcome", Text, nullable=False),
        Index(f"{prefix}audit_at_idx", "at"),
        **MYSQL_TABLE_OPTIONS,
    )


def _dead_letters_table(prefix: str, metadata: MetaData) -> Table:
    """``<prefix>dead_letters``: dead letters the broker refused, kept in the database.

    A dead letter goes to the broker's dead-letter queue / topic. When the broker refuses
    that one record for good (too large for the topic, rejected by a queue policy, not
    authorised), the processor keeps the original message here instead, in a
    transaction of its own, and then settles the delivery, so nothing behind it waits.
    ``mqdedup dead-letters list | replay | delete`` work on these rows. Message ids are
    unique per consumer (a redelivery parks nothing twice); messages without an id
    (``message_id`` NULL) are kept as often as they were refused.
    """
    return Table(
        f"{prefix}dead_letters",
        metadata,
        Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
        Column("consumer_name", KeyString(255), nullable=False),
        Column("message_id", KeyString(255), nullable=True),
        Column("source", Text, nullable=False),
        Column("source_partition", Integer, nullable=True),
        Column("source_offset", BigInteger, nullable=True),
        Column(
            "message_key",
            LargeBinary().with_variant(MYSQL_LONGBLOB(), "mysql", "mariadb"),
            nullable=True,
        ),
        # Header values as ``[name, "s" | "b" | "n", text | base64 | null]`` (Kafka
        # header values are bytes); AMQP properties as JSON.
        Column("headers", JSON, nullable=False),
        Column("properties", JSON, nullable=True),
        Column(
            "body",
            LargeBinary().with_variant(MYSQL_LONGBLOB(), "mysql", "mariadb"),
            nullable=False,
        ),
        Column("reason", Text, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("error_class", Text, nullable=True),
        Column("error_message", Text, nullable=True),
        #: Why the broker refused the dead letter.
        Column("refusal", Text, nullable=False),
        Column("parked_at", PreciseDateTime, nullable=False),
        UniqueConstraint("consumer_name", "message_id", name=f"{prefix}dead_letters_id_key"),
        Index(f"{prefix}dead_letters_parked_idx", "consumer_name", "id"),
        **MYSQL_TABLE_OPTIONS,
    )


def _outbox_table(prefix: str, metadata: MetaData) -> Table:
    """``<prefix>outbox``: outgoing messages written in business transactions (mqdedup.outbox).

    Plain data only: the payload as bytes, headers and AMQP properties as JSON. ``state``
    is ``pending`` until the relay published the row (``published``) or gave up on it
    after its attempts (``failed``, kept until retried), or deleted once published
    (``delete_published``, counted in ``<prefix>outbox_counts``). A claim writes nothing
    on the rows: the relay's lease is one row per relay in ``<prefix>outbox_leases``.
    ``shard_hash`` places the row's key in a shard owned by one relay.

    MySQL/MariaDB have no partial indexes: there the claim walks ``(state, id)`` and the
    per-key hold-back looks up ``(message_key, state, id)``, so neither reads the
    published history (the partial indexes are created on PostgreSQL and SQLite only).
    """
    pending = text("state = 'pending'")
    retrying = text("state = 'pending' AND attempts > 0")
    published = text("state = 'published'")
    return Table(
        f"{prefix}outbox",
        metadata,
        Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
        Column("message_id", KeyString(255), nullable=False),
        Column("broker", String(64), nullable=False),
        Column("destination", String(255), nullable=False),
        Column("routing_key", String(255), nullable=True),
        Column(
            "message_key",
            LargeBinary().with_variant(MYSQL_VARBINARY(767), "mysql", "mariadb"),
            nullable=True,
        ),
        Column("shard_hash", Integer, nullable=False),
        Column("headers", JSON, nullable=False),
        Column("properties", JSON, nullable=True),
        Column(
            "payload",
            LargeBinary().with_variant(MYSQL_LONGBLOB(), "mysql", "mariadb"),
            nullable=False,
        ),
        Column("state", String(16), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("last_error", Text, nullable=True),
        Column("created_at", PreciseDateTime, nullable=False),
        Column("available_at", PreciseDateTime, nullable=False),
        Column("published_at", PreciseDateTime, nullable=True),
        UniqueConstraint("message_id", name=f"{prefix}outbox_message_id_key"),
        only_on(
            Index(
                f"{prefix}outbox_pending_idx", "id", postgresql_where=pending, sqlite_where=pending
            ),
            _PARTIAL_INDEX_DIALECTS,
        ),
        # Rows waiting for a retry hold back later rows of their key (small: failures only).
        only_on(
            Index(
                f"{prefix}outbox_retrying_idx",
                "message_key",
                "id",
                postgresql_where=retrying,
                sqlite_where=retrying,
            ),
            _PARTIAL_INDEX_DIALECTS,
        ),
        # MySQL/MariaDB: the claim's range (pending rows in id order) and the hold-back's
        # lookup (a key's pending rows), in place of the partial indexes above.
        only_on(Index(f"{prefix}outbox_claim_idx", "state", "id"), _MYSQL_DIALECTS),
        only_on(
            Index(f"{prefix}outbox_key_state_idx", "message_key", "state", "id"), _MYSQL_DIALECTS
        ),
        Index(
            f"{prefix}outbox_published_idx",
            "published_at",
            postgresql_where=published,
            sqlite_where=published,
        ),
        # Room on each page for the mark's update (``state``, ``published_at``).
        postgresql_with={"fillfactor": 50},
        **MYSQL_TABLE_OPTIONS,
    )
