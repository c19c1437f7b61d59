"""mqdedup's tables, created from mqdedup.db.schema (see mqdedup.django.schema)."""

from typing import Any, ClassVar

from django.db import migrations  # type: ignore[import-untyped]

from mqdedup.django.conf import database_alias
from mqdedup.django.schema import create_tables, drop_tables


def forwards(_apps: Any, schema_editor: Any) -> None:
    alias = schema_editor.connection.alias
    if alias == database_alias():  # only where MQDEDUP["DATABASE"] points
        create_tables(alias)


def backwards(_apps: Any, schema_editor: Any) -> None:
    alias = schema_editor.connection.alias
    if alias == database_alias():
        drop_tables(alias)


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    # Not in an atomic block of its own: on MySQL/MariaDB each CREATE TABLE commits
    # implicitly, which would end a savepoint around it (PostgreSQL still runs the whole
    # migration in one transaction).
    operations: ClassVar[list[Any]] = [migrations.RunPython(forwards, backwards, atomic=False)]
