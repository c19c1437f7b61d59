"""Everything that differs between databases lives in this package, one module per job:

* :mod:`~mqdedup.db.dialects.errors`: which errors are *transient* (retry the
  transaction, never dead-letter), contention, pool timeouts, driver limits, data errors
  of one message, unique-key violations, decided by SQLSTATE / driver error code /
  exception class, never by the text of a message;
* :mod:`~mqdedup.db.dialects.claims`: the dedup table's claim (``INSERT … ON CONFLICT DO
  NOTHING RETURNING``; ``INSERT IGNORE`` on MySQL/MariaDB), the attempt-counter upserts,
  insert-unless-present and the latest-committed read;
* :mod:`~mqdedup.db.dialects.key_claims`: the HTTP idempotency key's claim;
* :mod:`~mqdedup.db.dialects.traits`: what each database can do (:func:`traits`), engine
  defaults and per-connection setup;
* :mod:`~mqdedup.db.dialects.relay`: the outbox relay's session settings, transactions,
  id lists, lock checks and table sizes.

The names below are the package's API (``from mqdedup.db.dialects import traits``).
"""

from mqdedup.db.dialects.claims import (
    check_mysql_key,
    claim_ids,
    increment_attempts,
    insert_unless_present,
    latest_committed,
    mysql_supports_returning,
    start_attempt,
)
from mqdedup.db.dialects.errors import (
    MYSQL_LOCK_WAIT_TIMEOUT,
    PGBOUNCER_QUERY_WAIT_TIMEOUT,
    PSYCOPG_MAX_PARAMETERS,
    driver_limit,
    is_contention,
    is_data_error,
    is_pool_timeout,
    is_pooler_queue_timeout,
    is_sqlite_lock_error,
    is_transient,
    is_unique_violation,
    mysql_code,
)
from mqdedup.db.dialects.key_claims import claim_key_nowait
from mqdedup.db.dialects.relay import (
    ADVISORY_LOCKS_HELD,
    CLAIM_SETTINGS,
    MARK_SETTINGS,
    RELAY_SESSION_SETTINGS,
    ids_clause,
    ids_params,
    named_locks_held,
    prepare_relay_connection,
    relay_transaction,
    table_size,
)
from mqdedup.db.dialects.traits import (
    MYSQL_DIALECTS,
    SUPPORTED,
    Traits,
    client_encoding,
    configure_engine,
    connect_defaults,
    traits,
)

__all__ = [
    "ADVISORY_LOCKS_HELD",
    "CLAIM_SETTINGS",
    "MARK_SETTINGS",
    "MYSQL_DIALECTS",
    "MYSQL_LOCK_WAIT_TIMEOUT",
    "PGBOUNCER_QUERY_WAIT_TIMEOUT",
    "PSYCOPG_MAX_PARAMETERS",
    "RELAY_SESSION_SETTINGS",
    "SUPPORTED",
    "Traits",
    "check_mysql_key",
    "claim_ids",
    "claim_key_nowait",
    "client_encoding",
    "configure_engine",
    "connect_defaults",
    "driver_limit",
    "ids_clause",
    "ids_params",
    "increment_attempts",
    "insert_unless_present",
    "is_contention",
    "is_data_error",
    "is_pool_timeout",
    "is_pooler_queue_timeout",
    "is_sqlite_lock_error",
    "is_transient",
    "is_unique_violation",
    "latest_committed",
    "mysql_code",
    "mysql_supports_returning",
    "named_locks_held",
    "prepare_relay_connection",
    "relay_transaction",
    "start_attempt",
    "table_size",
    "traits",
]
