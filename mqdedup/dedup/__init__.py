"""Dedup: the claim-store seam (SQL, Redis), the processed-messages table, message ids."""

from mqdedup.dedup import ids
from mqdedup.dedup.choices import RedisDedup, SqlDedup
from mqdedup.dedup.claims import AttemptLog, Claims, ClaimStore, Dedup
from mqdedup.dedup.store import DedupStore

__all__ = [
    "AttemptLog",
    "ClaimStore",
    "Claims",
    "Dedup",
    "DedupStore",
    "RedisDedup",
    "SqlDedup",
    "ids",
]
