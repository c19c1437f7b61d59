"""Loading a consumer class from a ``module.path:ClassName`` reference."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from mqdedup.consumers.base import Consumer
from mqdedup.errors import ConsumerImportError, MqdedupError


def load_consumer_class(reference: str) -> type[Consumer]:
    """Import ``module.path:ClassName`` and check that it is a Consumer subclass."""
    target = _import_reference(reference)
    if not (isinstance(target, type) and issubclass(target, Consumer)):
        raise ConsumerImportError(f"{reference!r} is not a mqdedup Consumer subclass")
    return target


def create_consumer(reference: str) -> Consumer:
    """Load ``module.path:ClassName`` and create the consumer (its ``__init__`` takes none).

    A class whose ``__init__`` needs arguments, or that raises while being created, is
    refused with one line naming it.
    """
    cls = load_consumer_class(reference)
    try:
        inspect.signature(cls).bind()
    except TypeError as exc:
        raise ConsumerImportError(
            f"{reference} cannot be created without arguments: {exc} "
            "(the CLI creates consumers as ClassName())"
        ) from None
    except ValueError:  # no signature to inspect (a C type): just try
        pass
    try:
        return cls()
    except MqdedupError:
        raise
    except Exception as exc:
        raise ConsumerImportError(
            f"creating {reference} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _import_reference(reference: str) -> Any:
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
        return getattr(module, attribute)
    except AttributeError as exc:
        raise ConsumerImportError(f"module {module_name!r} has no attribute {attribute!r}") from exc
