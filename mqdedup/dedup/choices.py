"""How a consumer chooses its claim store: the ``dedup`` class attribute.

``SqlDedup()`` (the default) keeps claims in the consumer's dedup table, in the
handler's transaction; ``RedisDedup(lease=..., retention=...)`` keeps them in Redis for
handlers without a database write. Neither imports ``redis`` until a store is built,
so ``RedisDedup`` is importable without the ``redis`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from mqdedup.dedup.claims import ClaimStore
from mqdedup.dedup.redis_settings import DEFAULT_REDIS_NAMESPACE, expiry_seconds
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

#: The longest lease or retention a Redis store accepts (10 years): expiries are finite.


@dataclass(frozen=True)
class SqlDedup:
    """Claims in the dedup table of the consumer's database (the default).

    The claim is the first statement of the handler's transaction: effectively-once
    (promise 3). The table is ``<table_prefix>processed_messages``.
    """

    needs_database: bool = field(default=True, init=False)

    def create_store(self, prefix: str, sessions: sessionmaker[Session] | None) -> ClaimStore:
        """The dedup table store over ``sessions`` (required)."""
        if sessions is None:
            raise ConfigurationError(
                "this consumer keeps its claims in the database (the default dedup): "
                "pass a database engine or session factory"
            )
        return DedupStore(prefix, sessions)

    def check(self) -> None:
        """Nothing here: the CLI checks the database itself."""

    def describe(self) -> str:
        """(A SQL-claimed consumer always has a transaction.)"""
        return "the dedup table"


@dataclass(frozen=True)
class RedisDedup:
    """Claims in Redis with a lease: for handlers without a database write.

    ``lease``: how long a claim protects a message being handled (and how long a
    crashed worker's messages wait); it must exceed the slowest handler, and is renewed
    while a worker works through its batch. ``retention``: how long completed ids and
    their results are remembered. ``url``: the Redis URL (default ``MQDEDUP_REDIS_URL``,
    which ``mqdedup worker --redis-url`` sets). ``namespace`` prefixes every key.

    At-least-once with a narrow window, not the database's exactly-once: see
    ``docs/tools.md`` ("Redis dedup").
    """

    lease: timedelta | float = 60.0
    retention: timedelta | float = timedelta(days=7)
    url: str | None = None
    namespace: str = DEFAULT_REDIS_NAMESPACE
    needs_database: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if "{" in self.namespace or "}" in self.namespace:
            raise ConfigurationError(
                f"Redis dedup namespace {self.namespace!r} must not contain '{{' or '}}' "
                "(the consumer name is the keys' Redis Cluster hash tag)"
            )
        expiry_seconds(self.lease, "lease")
        expiry_seconds(self.retention, "retention")

    @property
    def lease_seconds(self) -> float:
        """``lease`` in seconds."""
        return expiry_seconds(self.lease, "lease")

    @property
    def retention_seconds(self) -> float:
        """``retention`` in seconds."""
        return expiry_seconds(self.retention, "retention")

    def create_store(self, prefix: str, sessions: sessionmaker[Session] | None) -> ClaimStore:
        """A Redis store for these settings (no database: ``sessions`` is not used)."""
        from mqdedup.dedup.redis_claims import RedisClaimStore

        return RedisClaimStore(
            self.url, namespace=self.namespace, lease=self.lease, retention=self.retention
        )

    def check(self) -> None:
        """PING Redis once; RedisUnavailableError (exit code 5 in the CLI) if it fails."""
        from mqdedup.dedup.redis_client import check_redis, redis_client

        client = redis_client(self.url)
        try:
            check_redis(client)
        finally:
            client.close()

    def describe(self) -> str:
        """Names the choice in error messages."""
        return "Redis (dedup = RedisDedup(...))"
