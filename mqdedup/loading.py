"""Loading a consumer class from a ``module.path:ClassName`` reference."""

from __future__ import annotations

import importlib

from mqdedup.consumers.base import Consumer
from mqdedup.errors import ConsumerImportError


def load_consumer_class(reference: str) -> type[Consumer]:
    """Import ``module.path:ClassName`` and check that it is a Consumer subclass."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ConsumerImportError(
            f"consumer reference {reference!r} must look like 'module.path:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConsumerImportError(f"cannot import module {module_name!r}: {exc}") from exc
    except Exception as exc:
        raise ConsumerImportError(
            f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        target = getattr(module, attribute)
    except AttributeError as exc:
        raise ConsumerImportError(f"module {module_name!r} has no attribute {attribute!r}") from exc
    if not (isinstance(target, type) and issubclass(target, Consumer)):
        raise ConsumerImportError(f"{reference!r} is not a mqdedup Consumer subclass")
    return target
