"""The relay's settings: how it claims, retries and cleans up (:class:`RelayConfig`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

from mqdedup.errors import ConfigurationError


@dataclass(frozen=True)
class RelayConfig:
    """How a relay claims, retries and cleans up.

    * ``batch_size``: rows per claim (and per flush / confirm round). A relay holds up to
      three batches (one claimed ahead, one publishing, one being marked): lower it when
      rows are large. Larger batches spread each batch's fixed costs (the claim's round
      trip, the final flush or the last confirms) over more rows.
    * ``poll_interval``: seconds between polls when no notification arrives.
    * ``lease``: seconds a claimed row stays reserved; must exceed the time to publish a
      batch (the publishers' own timeouts), or a slow batch is published twice.
    * ``max_attempts``, ``initial_backoff``, ``max_backoff``: per-row retries after the
      broker refused the row (unroutable, too large); then the row is ``failed``.
    * ``broker_backoff_max``: longest pause between tries while a broker is unavailable.
    * ``database_backoff_max``: longest pause between tries while the database is down.
    * ``delete_published``: delete rows once published and count them per destination
      and hour in ``<prefix>outbox_counts`` (the default: a delete costs the database
      about a fifth of the mark's update); ``False`` marks them ``published`` and keeps
      them for ``retention``.
    * ``retention``: published rows kept (``delete_published=False``) older than this are
      purged every ``purge_interval`` seconds, ``purge_chunk_size`` rows per transaction
      (``None``: never).
    * ``shards``: PostgreSQL and MySQL/MariaDB; every relay of one table must use the
      same number.
    * ``rebalance_interval``: seconds between shard rebalancing checks.
    * ``listen``: use ``LISTEN``/``NOTIFY`` on PostgreSQL (MySQL/MariaDB always poll).
    """

    batch_size: int = 2000
    poll_interval: float = 1.0
    lease: float = 60.0
    max_attempts: int = 10
    initial_backoff: float = 1.0
    max_backoff: float = 300.0
    broker_backoff_max: float = 10.0
    database_backoff_max: float = 5.0
    delete_published: bool = True
    retention: timedelta | None = timedelta(days=7)
    purge_interval: float = 600.0
    purge_chunk_size: int = 5000
    shards: int = 16
    rebalance_interval: float = 5.0
    listen: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigurationError("relay batch_size must be at least 1")
        if self.max_attempts < 1:
            raise ConfigurationError("relay max_attempts must be at least 1")
        if self.lease <= 0 or self.poll_interval <= 0:
            raise ConfigurationError("relay lease and poll_interval must be positive")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.broker_backoff_max <= 0:
            raise ConfigurationError(
                "relay backoffs must not be negative and broker_backoff_max must be positive"
            )
        if self.purge_chunk_size < 1:
            raise ConfigurationError("relay purge_chunk_size must be at least 1")

    def row_backoff(self, attempts: int) -> float:
        """Seconds before a refused row's next try (exponential, capped, ±10% jitter)."""
        base = min(self.max_backoff, self.initial_backoff * 2.0 ** (attempts - 1))
        return float(base * random.uniform(0.9, 1.1))
