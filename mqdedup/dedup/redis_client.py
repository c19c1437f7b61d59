"""Redis connections for the Redis backends (the ``redis`` extra), with clear errors."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from mqdedup.errors import ConfigurationError, DatabaseUnavailableError
from mqdedup.extras import missing_extra
from mqdedup.masking import mask_text, mask_url

try:
    import redis
except ImportError as _missing:  # the redis extra
    raise missing_extra("the Redis claim store (RedisDedup)", "redis", _missing) from None
from redis import exceptions as redis_errors

REDIS_URL_ENV = "MQDEDUP_REDIS_URL"
_SCHEMES = ("redis", "rediss", "unix")


class RedisUnavailableError(DatabaseUnavailableError):
    """Redis cannot be reached (for the CLI, the dedup store is down: exit code 5)."""


def mask_redis_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***`` (:func:`mqdedup.masking.mask_url`)."""
    return mask_url(url)


def redis_url_from_env() -> str:
    """``MQDEDUP_REDIS_URL``; a missing one raises ConfigurationError."""
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        raise ConfigurationError(f"{REDIS_URL_ENV} is not set (e.g. redis://127.0.0.1:6379/0)")
    return url


def redis_client(client: redis.Redis | str | None = None, *, timeout: float = 5.0) -> redis.Redis:
    """``client`` itself, or a client for a ``redis://`` URL (default: the environment).

    URL clients get connect and socket timeouts, so an unreachable server fails fast
    with :class:`RedisUnavailableError` at the first command rather than hanging.
    """
    if isinstance(client, redis.Redis):
        return client
    url = client if client is not None else redis_url_from_env()
    if urlsplit(url).scheme not in _SCHEMES:
        raise ConfigurationError(
            f"Redis URL {mask_redis_url(url)!r} must start with redis://, rediss:// or unix://"
        )
    try:
        return redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=30,
        )
    except ValueError as exc:
        raise ConfigurationError(
            f"malformed Redis URL {mask_redis_url(url)!r}: {mask_text(str(exc), url)}"
        ) from None


def is_transient_redis_error(error: BaseException) -> bool:
    """True for Redis failures worth waiting out (connection lost, timeout, loading)."""
    return isinstance(
        error,
        redis_errors.ConnectionError
        | redis_errors.TimeoutError
        | redis_errors.BusyLoadingError
        | redis_errors.TryAgainError
        | redis_errors.ClusterDownError
        | redis_errors.ReadOnlyError,
    )


def check_redis(client: redis.Redis) -> None:
    """PING once; raise RedisUnavailableError with a one-line reason if that fails."""
    try:
        client.ping()
    except redis_errors.RedisError as exc:
        kwargs = client.connection_pool.connection_kwargs
        where = f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RedisUnavailableError(f"cannot reach Redis at {where}: {reason}") from exc
