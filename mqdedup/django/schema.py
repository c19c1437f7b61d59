"""mqdedup's tables on a Django alias, from :mod:`mqdedup.db.schema` (its one source).

The migrations of this app call these functions, so ``manage.py migrate`` creates
exactly the tables, indexes and collations ``mqdedup db init`` would, and
``mqdedup db check`` finds nothing to fix afterwards.
"""

from __future__ import annotations

import logging

from mqdedup.db.engine import init_schema
from mqdedup.db.migrations import upgrade_schema
from mqdedup.db.schema import schema
from mqdedup.django.conf import table_prefix
from mqdedup.django.connection import engine

log = logging.getLogger(__name__)


def create_tables(alias: str) -> list[str]:
    """Create the missing tables of ``MQDEDUP["TABLE_PREFIX"]`` and remove any drift
    (missing indexes); return what was done."""
    bound = engine(alias)
    prefix = table_prefix()
    done = init_schema(bound, prefix)
    done.extend(upgrade_schema(bound, prefix))
    return done


def drop_tables(alias: str) -> None:
    """Drop the tables of ``MQDEDUP["TABLE_PREFIX"]`` (unapplying the migration)."""
    schema(table_prefix()).metadata.drop_all(engine(alias))
