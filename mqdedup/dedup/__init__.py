"""Dedup: the claim-store seam (SQL, Redis), the processed-messages table, message ids."""

from mqdedup.dedup import ids
from mqdedup.dedup.choices import RedisDedup, SqlDedup
from mqdedup.dedup.claims import AttemptLog, Claims, ClaimStore, Dedup
from mqdedup.dedup.store import DedupStore
from mqdedup.dedup.unique_keys import (
    InsertOrGet,
    InsertOrGetError,
    async_insert_or_get,
    insert_or_get,
)

__all__ = [
    "AttemptLog",
    "ClaimStore",
    "Claims",
    "Dedup",
    "DedupStore",
    "InsertOrGet",
    "InsertOrGetError",
    "RedisDedup",
    "SqlDedup",
    "async_insert_or_get",
    "ids",
    "insert_or_get",
]
