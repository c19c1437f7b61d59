"""Settings shared by the Redis claim store and its configuration (no ``redis`` import)."""

from __future__ import annotations

from datetime import timedelta

from mqdedup.errors import ConfigurationError

MAX_EXPIRY_SECONDS = 10 * 365 * 24 * 3600.0
DEFAULT_REDIS_NAMESPACE = "mqdedup:dedup:"


def expiry_seconds(value: timedelta | float, what: str) -> float:
    """``value`` in seconds; ConfigurationError unless 0 < seconds <= 10 years."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not 0 < seconds <= MAX_EXPIRY_SECONDS:
        raise ConfigurationError(
            f"Redis dedup {what} must be positive and at most {MAX_EXPIRY_SECONDS:.0f} "
            f"seconds (10 years), got {value!r}"
        )
    return seconds
