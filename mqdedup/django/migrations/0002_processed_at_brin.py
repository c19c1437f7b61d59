"""Schema 3: on PostgreSQL the dedup table's retention index becomes BRIN.

``<prefix>processed_at_brin`` (BRIN on ``processed_at``) replaces the btree
``<prefix>processed_at_idx``, which cost every claim an index update (see
:mod:`mqdedup.db.schema`). The change is ``mqdedup db upgrade``'s, from the same
metadata. MySQL/MariaDB and SQLite keep the btree: nothing to do there. A database
migrated by 0001 of this version has the BRIN already; this finds nothing to do.
"""

from typing import Any, ClassVar

from django.db import migrations  # type: ignore[import-untyped]

from mqdedup.django.conf import database_alias
from mqdedup.django.schema import create_tables


def forwards(_apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.alias == database_alias() and connection.vendor == "postgresql":
        create_tables(connection.alias)  # the missing BRIN created, the btree dropped


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies: ClassVar[list[tuple[str, str]]] = [("mqdedup", "0001_initial")]
    # Backwards is a no-op: an older mqdedup reads either index; its `db upgrade`
    # recreates the btree.
    operations: ClassVar[list[Any]] = [migrations.RunPython(forwards, migrations.RunPython.noop)]
