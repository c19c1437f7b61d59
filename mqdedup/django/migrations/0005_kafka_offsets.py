"""Schema 6: ``<prefix>kafka_offsets`` (Kafka offsets stored in the business transaction,
``KafkaConsumer.offsets_in_database``).

The table comes from :mod:`mqdedup.db.schema`, as ``mqdedup db init`` / ``db upgrade``
create it: ``create_tables`` creates the missing tables on every database.
"""

from typing import Any, ClassVar

from django.db import migrations  # type: ignore[import-untyped]

from mqdedup.django.conf import database_alias
from mqdedup.django.schema import create_tables


def forwards(_apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.alias == database_alias():
        create_tables(schema_editor.connection.alias)  # the new table, created if missing


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies: ClassVar[list[tuple[str, str]]] = [("mqdedup", "0004_audit")]
    # Backwards is a no-op: an older mqdedup ignores the table.
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(forwards, migrations.RunPython.noop, atomic=False)
    ]
