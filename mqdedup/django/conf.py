"""mqdedup's Django settings: the ``MQDEDUP`` dictionary of the project's settings.

::

    MQDEDUP = {
        "DATABASE": "default",        # the alias whose transactions hold the claims
        "TABLE_PREFIX": "mqdedup_",   # mqdedup's own tables (migrations, workers, relay)
    }

Both keys are optional. Anything else in the dictionary is refused, so a typo is a
one-line error instead of a silently ignored setting.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings  # type: ignore[import-untyped]

from mqdedup.db.schema import DEFAULT_PREFIX, validate_prefix
from mqdedup.errors import ConfigurationError

SETTINGS_NAME = "MQDEDUP"
_KNOWN = frozenset({"DATABASE", "TABLE_PREFIX"})


def _settings() -> dict[str, Any]:
    value = getattr(settings, SETTINGS_NAME, None) or {}
    if not isinstance(value, dict):
        raise ConfigurationError(f"settings.{SETTINGS_NAME} must be a dict, not {value!r:.60}")
    unknown = sorted(set(value) - _KNOWN)
    if unknown:
        raise ConfigurationError(
            f"unknown key(s) {', '.join(unknown)} in settings.{SETTINGS_NAME} "
            f"(known: {', '.join(sorted(_KNOWN))})"
        )
    return value


def database_alias(using: str | None = None) -> str:
    """``using``, else ``MQDEDUP["DATABASE"]``, else ``"default"``; must be in DATABASES."""
    alias = using or str(_settings().get("DATABASE") or "default")
    if alias not in settings.DATABASES:
        raise ConfigurationError(
            f"database alias {alias!r} is not in settings.DATABASES "
            f"(set {SETTINGS_NAME}['DATABASE'] or pass using=...)"
        )
    return alias


def table_prefix() -> str:
    """``MQDEDUP["TABLE_PREFIX"]``, else mqdedup's default prefix."""
    return validate_prefix(str(_settings().get("TABLE_PREFIX") or DEFAULT_PREFIX))


def database_url(using: str | None = None) -> str:
    """The SQLAlchemy URL of a Django alias (for the relay and the CLI's own checks,
    which open connections of their own); the password included, never log it."""
    from sqlalchemy.engine import URL

    alias = database_alias(using)
    config = settings.DATABASES[alias]
    engine = str(config.get("ENGINE", ""))
    if engine.endswith(".sqlite3"):
        return f"sqlite:///{config['NAME']}"
    drivers = {".postgresql": "postgresql+psycopg", ".mysql": "mysql+pymysql"}
    driver = next((name for suffix, name in drivers.items() if engine.endswith(suffix)), None)
    if driver is None:
        raise ConfigurationError(
            f"database {alias!r} uses {engine}; mqdedup.django supports the postgresql, "
            "mysql and sqlite3 backends"
        )
    port = config.get("PORT")
    url = URL.create(
        driver,
        username=config.get("USER") or None,
        password=config.get("PASSWORD") or None,
        host=config.get("HOST") or None,
        port=int(port) if port else None,
        database=config.get("NAME") or None,
        query={"charset": "utf8mb4"} if driver.startswith("mysql") else {},
    )
    return url.render_as_string(hide_password=False)
