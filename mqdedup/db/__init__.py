"""The database layer: engine, schema (SQLAlchemy MetaData), dialects, migrations.

Every difference between PostgreSQL, MySQL/MariaDB and SQLite lives in
:mod:`mqdedup.db.dialects`; the rest of mqdedup writes SQLAlchemy Core.
"""

from mqdedup.db.engine import check_connection, create_engine, init_schema, session_factory

__all__ = ["check_connection", "create_engine", "init_schema", "session_factory"]
