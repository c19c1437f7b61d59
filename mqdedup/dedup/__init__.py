"""Dedup: the processed-messages store and message-id strategies."""

from mqdedup.dedup import ids
from mqdedup.dedup.store import DedupStore

__all__ = ["DedupStore", "ids"]
