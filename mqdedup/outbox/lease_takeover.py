"""Shards taken over from another relay wait for its leases (:class:`LeaseTakeover`)."""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from mqdedup.outbox.store import OutboxStore

log = logging.getLogger(__name__)


class LeaseTakeover:
    """Which owned shards are safe to claim from (see :meth:`claimable`)."""

    def __init__(self, engine: Engine, store: OutboxStore, relay_id: str) -> None:
        self.engine = engine
        self.store = store
        self.relay_id = relay_id
        self._verified: set[int] = set()

    def claimable(self, owned: set[int]) -> set[int]:
        """The owned shards that are safe to claim from.

        A shard just taken over may hold rows a relay that died was publishing; they must
        be published before later rows of their keys, so the shard waits until that
        relay's lease has expired (or the relay settled its batches and removed it).
        """
        self._verified &= owned
        unverified = owned - self._verified
        if unverified:
            held = self.store.foreign_leases(self.engine, self.relay_id) & unverified
            self._verified |= unverified - held
            if held:
                log.info(
                    "waiting for another relay's leases to expire before claiming",
                    extra={"relay": self.relay_id, "shards": sorted(held)},
                )
        return set(self._verified)
