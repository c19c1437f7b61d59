"""Optional dependencies: an ImportError that names the extra to install.

``import mqdedup.kafka`` without kafka-python fails with
``ImportError: mqdedup.kafka needs kafka-python: pip install 'mqdedup[kafka]'`` rather
than a bare ``No module named 'kafka'``. Each module that needs an optional package
imports it through :func:`require` (or calls :func:`missing_extra` in its own
``except ImportError``), so the error names what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "missing_extra", "require"]

#: import name -> (distribution to install, the mqdedup extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "kafka": ("kafka-python", "kafka"),
    "pika": ("pika", "rabbitmq"),
    "psycopg": ("psycopg", "postgresql"),
    "redis": ("redis", "redis"),
    "pymysql": ("pymysql", "mysql"),
    "django": ("django", "django"),
    "fastapi": ("fastapi", "fastapi"),
    "opentelemetry": ("opentelemetry-api", "otel"),
    "pydantic": ("pydantic", "pydantic"),
    "msgspec": ("msgspec", "msgspec"),
    "greenlet": ("greenlet", "asyncio"),
}


def missing_extra(who: str, module: str, error: ImportError | None = None) -> ImportError:
    """The ImportError to raise when ``who`` cannot import ``module`` (an optional one).

    ``error``: the original one; when it is about another module (a broken install of
    a dependency's own dependency), it is returned unchanged so nothing is hidden.
    """
    top = module.split(".", 1)[0]
    if error is not None and error.name is not None and error.name.split(".", 1)[0] != top:
        return error
    distribution, extra = EXTRAS[top]
    return ImportError(f"{who} needs {distribution}: pip install 'mqdedup[{extra}]'", name=top)


def require(who: str, module: str) -> ModuleType:
    """``importlib.import_module(module)``, or the ImportError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise missing_extra(who, module, error) from None
