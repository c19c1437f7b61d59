"""Chooses the shard coordinator of a database for the relay (:func:`create_coordinator`).

Several relays can run at once on PostgreSQL and MySQL/MariaDB: rows are sharded by key
hash and each shard is owned by one relay through a lock, so a key's rows are published
by one relay in id order. The relay sees this only through
:class:`~mqdedup.outbox.coordination.ShardCoordinator` (acquire shards, the claim's
still-held check, wake-ups, release), built here from the database's traits: advisory
locks and ``LISTEN``/``NOTIFY`` on PostgreSQL, named locks (``GET_LOCK``) and polling
every ``poll_interval`` on MySQL/MariaDB. SQLite has neither row locks nor advisory
locks: run a single relay there, which polls.
"""

from __future__ import annotations

from sqlalchemy import Engine

from mqdedup.db.dialects import traits
from mqdedup.outbox.coordination import ShardCoordinator
from mqdedup.outbox.mysql_coordination import MySQLCoordinator
from mqdedup.outbox.postgresql_coordination import PostgreSQLCoordinator


def create_coordinator(
    engine: Engine,
    *,
    table_name: str,
    channel: str,
    shards: int,
    fingerprint: str,
    listen: bool = True,
) -> ShardCoordinator | None:
    """The shard coordinator of ``engine``'s database; ``None`` where relays cannot share.

    Chosen by the ``shard_locks`` trait (:func:`mqdedup.db.dialects.traits`): advisory
    locks (PostgreSQL), named locks (MySQL/MariaDB) or none (SQLite: one relay).
    ``fingerprint`` names the relay's settings besides ``shards`` (its brokers): relays of
    one table must agree on both. ``listen`` (PostgreSQL) wakes the relay on commits.
    """
    locks = traits(engine).shard_locks
    if locks == "advisory":
        return PostgreSQLCoordinator(
            engine,
            table_name=table_name,
            channel=channel,
            shards=shards,
            fingerprint=fingerprint,
            listen=listen,
        )
    if locks == "named":
        return MySQLCoordinator(
            engine, table_name=table_name, shards=shards, fingerprint=fingerprint
        )
    return None
