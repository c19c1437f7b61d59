"""Relays in different coordination modes on one outbox table (issue 40, part 1).

    python bench/relay_modes_bench.py [--keys 120] [--per-key 50]

Every pair of the three PostgreSQL coordination modes (``session`` direct, ``control``:
statements through PgBouncer with a direct ``--control-database``, ``transaction``:
PgBouncer only) runs at once on one table while two writers add ``keys * per_key``
keyed rows (6,000 by default), and each pair is switched from one mode to the other
under load, both ways. Prints, per run, the ids the broker got twice and the keys whose
rows arrived out of order (:mod:`tests.integration.postgres_ha.mixed_modes`).

Needs ``MQDEDUP_TEST_DATABASE_URL``, ``MQDEDUP_TEST_PGBOUNCER_URL`` (transaction mode) and
``MQDEDUP_RABBITMQ_URL`` (``scripts/services.sh env``); uses its own tables and queues.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os

from mqdedup.db import create_engine
from tests.integration.outbox.helpers import OutboxDb, events_table
from tests.integration.postgres_ha.mixed_modes import MODES, run_pair
from tests.services import RabbitAdmin, prefixed_database, table_prefix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=120)
    parser.add_argument("--per-key", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    direct_url = os.environ["MQDEDUP_TEST_DATABASE_URL"]
    pooled_url = os.environ["MQDEDUP_TEST_PGBOUNCER_URL"]
    rabbitmq_url = os.environ["MQDEDUP_RABBITMQ_URL"]
    pairs = list(itertools.combinations(MODES, 2))
    runs = [(pair, False) for pair in pairs]
    runs += [(pair, True) for pair in pairs] + [((b, a), True) for a, b in pairs]
    rabbit = RabbitAdmin(rabbitmq_url)
    totals = [0, 0]
    try:
        for modes, rolling in runs:
            prefix = table_prefix()
            events = events_table(prefix)
            with prefixed_database(direct_url, "PostgreSQL", events.metadata, prefix=prefix) as db:
                pooled = create_engine(pooled_url)
                try:
                    result = run_pair(
                        modes,
                        direct=OutboxDb(
                            url=direct_url, engine=db.engine, prefix=prefix, events=events
                        ),
                        pooled=OutboxDb(
                            url=pooled_url, engine=pooled, prefix=prefix, events=events
                        ),
                        rabbit=rabbit,
                        rabbitmq_url=rabbitmq_url,
                        keys=args.keys,
                        per_key=args.per_key,
                        rolling=rolling,
                    )
                finally:
                    pooled.dispose()
            print(result.line(), flush=True)
            totals[0] += result.doubled
            totals[1] += result.order_problems
    finally:
        rabbit.close()
    print(f"total: {totals[0]} ids doubled, {totals[1]} keys out of order")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
