"""The settings of the ``mqdedup`` command, each from one source: a CLI flag, else an
``MQDEDUP_*`` environment variable, else the TOML file (``--config`` or
``MQDEDUP_CONFIG``), else the default; unknown keys of the file are refused, and the
table prefix a consumer runs with is agreed between its class and the configuration."""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqdedup.db.schema import schema
from mqdedup.errors import ConfigurationError

CONFIG_ENV = "MQDEDUP_CONFIG"


@dataclass(frozen=True)
class Setting:
    """One setting: its key in the file's section, its env variable, its default."""

    section: str
    key: str
    env: str | None
    default: Any
    kind: Callable[[Any], Any] = str
    #: Inclusive bounds of a number (``None``: any).
    bounds: tuple[int, int] | None = None


def boolean(raw: Any) -> bool:
    """A yes/no setting: TOML ``true`` / ``false``, or 1/0, true/false, yes/no, on/off."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"not a yes/no value: {raw!r}")


def coordination(raw: Any) -> str:
    """The relay's coordination: ``session`` or ``transaction``."""
    text = str(raw).strip().lower()
    if text not in ("session", "transaction"):
        raise ValueError(f"not 'session' or 'transaction': {raw!r}")
    return text


SETTINGS: dict[str, Setting] = {
    "database_url": Setting(
        "mqdedup", "database_url", "MQDEDUP_DATABASE_URL", "sqlite:///mqdedup.db"
    ),
    "kafka_bootstrap": Setting("mqdedup", "kafka_bootstrap", "MQDEDUP_KAFKA_BOOTSTRAP", None),
    "rabbitmq_url": Setting("mqdedup", "rabbitmq_url", "MQDEDUP_RABBITMQ_URL", None),
    "redis_url": Setting("mqdedup", "redis_url", "MQDEDUP_REDIS_URL", None),
    "table_prefix": Setting("mqdedup", "table_prefix", "MQDEDUP_TABLE_PREFIX", "mqdedup_"),
    "log_level": Setting("mqdedup", "log_level", "MQDEDUP_LOG_LEVEL", "WARNING"),
    "log_format": Setting("mqdedup", "log_format", "MQDEDUP_LOG_FORMAT", "text"),
    "processes": Setting("worker", "processes", "MQDEDUP_PROCESSES", 1, int),
    "shutdown_timeout": Setting(
        "worker", "shutdown_timeout", "MQDEDUP_SHUTDOWN_TIMEOUT", 30.0, float
    ),
    "health_port": Setting(
        "worker", "health_port", "MQDEDUP_HEALTH_PORT", None, int, bounds=(0, 65535)
    ),
    # 0.0.0.0: probes and scrapers reach a pod on its own address; 127.0.0.1 keeps the
    # endpoint on the machine.
    "health_host": Setting("worker", "health_host", "MQDEDUP_HEALTH_HOST", "0.0.0.0"),  # noqa: S104
    "relay_processes": Setting("relay", "processes", "MQDEDUP_RELAY_PROCESSES", 1, int),
    "poll_interval": Setting("relay", "poll_interval", "MQDEDUP_POLL_INTERVAL", 1.0, float),
    "relay_batch_size": Setting("relay", "batch_size", "MQDEDUP_RELAY_BATCH_SIZE", 2000, int),
    "relay_keep_published": Setting(
        "relay", "keep_published", "MQDEDUP_RELAY_KEEP_PUBLISHED", False, boolean
    ),
    "control_database_url": Setting(
        "relay", "control_database_url", "MQDEDUP_CONTROL_DATABASE_URL", None
    ),
    "relay_coordination": Setting(
        "relay", "coordination", "MQDEDUP_RELAY_COORDINATION", "session", coordination
    ),
}


def env_help(name: str) -> str:
    """`` (env MQDEDUP_X, default Y)`` for argparse help texts."""
    setting = SETTINGS[name]
    default = "" if setting.default is None else f", default {setting.default}"
    return f" (env {setting.env}{default})"


def load_file(path: str | None) -> dict[str, Any]:
    """Parse the TOML config file (``--config`` or ``MQDEDUP_CONFIG``); {} if none.

    Example file::

        [mqdedup]
        database_url = "postgresql://app:secret@db/app"
        kafka_bootstrap = "kafka-1:9092,kafka-2:9092"
        rabbitmq_url = "amqp://app:secret@rabbit/%2F"
        redis_url = "redis://redis:6379/0"    # consumers with dedup = RedisDedup(...) only
        table_prefix = "mqdedup_"
        log_level = "INFO"

        [worker]
        processes = 4
        shutdown_timeout = 30
        health_port = 9400

        [relay]
        processes = 1
        poll_interval = 1.0
        batch_size = 500
        # behind PgBouncer in transaction mode (docs/operations.md): one of
        # control_database_url = "postgresql://app:secret@db-direct/app"
        # coordination = "transaction"
    """
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    try:
        with Path(path).open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigurationError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config file {path} is not valid TOML: {exc}") from exc
    check_keys(data, path)
    return data


def check_keys(data: Mapping[str, Any], path: str) -> None:
    """Refuse unknown sections and keys (a typo would silently fall back to a default)."""
    sections: dict[str, set[str]] = {}
    for setting in SETTINGS.values():
        sections.setdefault(setting.section, set()).add(setting.key)
    for name, value in data.items():
        if name not in sections:
            owner = [s.section for s in SETTINGS.values() if s.key == name]
            if owner and not isinstance(value, dict):
                raise ConfigurationError(
                    f"setting {name!r} outside a section in {path} (put it under [{owner[0]}])"
                )
            raise ConfigurationError(
                f"unknown section [{name}] in {path}{_did_you_mean(name, sections, '[{}]')}"
            )
        if not isinstance(value, dict):
            raise ConfigurationError(f"[{name}] in {path} must be a section (a TOML table)")
        for key in value:
            if key not in sections[name]:
                raise ConfigurationError(
                    f"unknown setting {key!r} in [{name}] of {path}"
                    f"{_did_you_mean(key, sections[name], '{!r}')}"
                )


def _did_you_mean(word: str, choices: Any, form: str) -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    if close:
        return f" (did you mean {form.format(close[0])}?)"
    return f" (known: {', '.join(form.format(c) for c in sorted(choices))})"


def resolve(
    name: str,
    flag_value: Any,
    file_data: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> Any:
    """The value of setting ``name``: flag, else env, else file, else default."""
    return resolve_with_source(name, flag_value, file_data, environ)[0]


def resolve_with_source(
    name: str,
    flag_value: Any,
    file_data: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    *,
    flag: str | None = None,
) -> tuple[Any, str | None]:
    """The value of setting ``name`` and where it came from (``None``: the default).

    The source reads like ``--table-prefix``, ``environment variable MQDEDUP_X`` or
    ``config [mqdedup] x``, for error messages.
    """
    setting = SETTINGS[name]
    environ = os.environ if environ is None else environ
    if flag_value is not None:
        source = flag or f"--{name.replace('_', '-')}"
        return check_bounds(name, flag_value, source), source
    raw: Any = None
    source = ""
    if setting.env and environ.get(setting.env):
        raw, source = environ[setting.env], f"environment variable {setting.env}"
    elif setting.key in file_data.get(setting.section, {}):
        raw, source = (
            file_data[setting.section][setting.key],
            f"config [{setting.section}] {setting.key}",
        )
    if raw is None:
        return setting.default, None
    try:
        value = setting.kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"{source}: expected {setting.kind.__name__}, got {raw!r}"
        ) from exc
    return check_bounds(name, value, source), source


def check_bounds(name: str, value: Any, source: str) -> Any:
    """``value`` if setting ``name`` accepts it, else ConfigurationError naming ``source``."""
    bounds = SETTINGS[name].bounds
    if bounds is not None and value is not None and not bounds[0] <= value <= bounds[1]:
        raise ConfigurationError(
            f"{source}: {value} is out of range for {name} ({bounds[0]}-{bounds[1]})"
        )
    return value


def declared_table_prefix(consumer_class: type) -> str | None:
    """The ``table_prefix`` the user's consumer class (or a user base class) sets, if any.

    mqdedup's own base classes only carry the default, which configuration overrides.
    """
    for klass in consumer_class.__mro__:
        if "table_prefix" in vars(klass):
            if klass.__module__ == "mqdedup" or klass.__module__.startswith("mqdedup."):
                return None
            return str(vars(klass)["table_prefix"])
    return None


def consumer_table_prefix(
    consumer_class: type, configured: str, source: str | None, reference: str
) -> str:
    """The table prefix a consumer runs with: one source of truth for its tables.

    ``configured`` is the resolved ``table_prefix`` setting and ``source`` where it came
    from (``None``: nobody set it, it is the default). The configured prefix
    (``--table-prefix`` > ``MQDEDUP_TABLE_PREFIX`` > TOML) applies to consumer classes
    that do not set ``table_prefix``; a class that sets it keeps it when nothing is
    configured. When both are set and differ, the worker would write claims and outbox
    rows to other tables than the relay and the other commands read: refused.
    """
    declared = declared_table_prefix(consumer_class)
    if source is None:
        return declared if declared is not None else configured
    if declared is not None and declared != configured:
        raise ConfigurationError(
            f"{reference} sets table_prefix = {declared!r} but {source} says {configured!r}: "
            "make them agree or remove one (the relay and the other commands use the "
            "configured prefix)"
        )
    return configured


def use_table_prefix(consumer: object, prefix: str) -> None:
    """Make ``consumer`` (an instance) use the tables of ``prefix``."""
    if getattr(consumer, "table_prefix", None) != prefix:
        # An instance attribute shadows the class attribute for this consumer only.
        object.__setattr__(consumer, "table_prefix", prefix)


def resolve_settings(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """Resolve settings for a command: flag > env > config file > default."""
    file_data = load_file(getattr(args, "config", None))
    flags = {
        "relay_processes": getattr(args, "processes", None),
        "poll_interval": getattr(args, "poll_interval", None),
        "relay_batch_size": getattr(args, "batch_size", None),
        "relay_keep_published": getattr(args, "keep_published", None),
        "control_database_url": getattr(args, "control_database", None),
        "relay_coordination": getattr(args, "coordination", None),
        "database_url": getattr(args, "database", None),
        "table_prefix": getattr(args, "table_prefix", None),
        "kafka_bootstrap": getattr(args, "kafka_bootstrap", None),
        "rabbitmq_url": getattr(args, "rabbitmq_url", None),
        "redis_url": getattr(args, "redis_url", None),
        "processes": getattr(args, "processes", None),
        "shutdown_timeout": getattr(args, "shutdown_timeout", None),
        "health_port": getattr(args, "health_port", None),
        "health_host": getattr(args, "health_host", None),
        "log_level": getattr(args, "log_level", None),
        "log_format": getattr(args, "log_format", None),
    }
    wanted = names or ("database_url", "table_prefix")
    settings = {name: resolve(name, flags.get(name), file_data) for name in wanted}
    if "table_prefix" in settings:
        settings["table_prefix"] = _table_prefix(args)[0]
    return settings


def _table_prefix(args: argparse.Namespace) -> tuple[str, str | None]:
    """The configured table prefix, validated, and where it came from (None: default).

    A prefix the tables cannot hold (characters, identifier length) is refused here,
    before anything connects.
    """

    flag = getattr(args, "table_prefix", None)
    file_data = load_file(getattr(args, "config", None))
    prefix, source = resolve_with_source("table_prefix", flag, file_data)
    try:
        schema(prefix)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source or 'default'}: {exc}") from None
    return prefix, source


def consumer_prefix(args: argparse.Namespace, reference: str, consumer: Any) -> str:
    """Give ``consumer`` the table prefix it runs with (see :func:`consumer_table_prefix`)."""
    configured, source = _table_prefix(args)
    prefix = consumer_table_prefix(type(consumer), configured, source, reference)
    use_table_prefix(consumer, prefix)
    return prefix
