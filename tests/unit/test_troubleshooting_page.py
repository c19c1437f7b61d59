"""docs/troubleshooting.md names every exception a user can meet (issue 43).

Every exception class defined in ``mqdedup`` is either on the page (with its meaning and
fix) or listed here as internal: control flow between mqdedup's own parts that never
reaches a user. A new error class fails this test until it is documented or listed.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import mqdedup
from tests.services import REPO

#: Raised and caught inside mqdedup; a user never sees them.
INTERNAL = {
    "BatchAbandonedError",  # a stop during a claim-store outage, caught by the worker
    "ClosingError",  # the RabbitMQ transport is closing: ends its reconnect loop
    "ImmediateStop",  # a second signal, turned into exit code 130
    "InvalidBodiesError",  # invalid bodies in a batch: it reruns without them
    "MessageDatabaseError",  # the outage probe's verdict, turned into a message failure
    "NotAnOutageError",  # the same, for the outage wait
    "PositionFencedError",  # a fenced offset-row write: the processor gives the batch back
    "RelayStoppedError",  # a stop while the relay waited for the database
    "SimulatedCrash",  # fault injection in the demo and the test kit
    "StopWhileWaiting",  # a stop signal during a wait, turned into a clean stop
    "StoppedDuringOutageError",  # the same, during an outage
    "UnavailableError",  # the RabbitMQ publisher's retry signal, turned into an outage wait
}


def _exception_classes() -> set[str]:
    names: set[str] = set()
    for info in pkgutil.walk_packages(mqdedup.__path__, "mqdedup."):
        if info.name.startswith("mqdedup.django"):
            continue  # needs a configured Django; its errors come from request_keys
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                names.add(name)
    return names


def test_every_user_facing_exception_is_on_the_troubleshooting_page() -> None:
    page = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    classes = _exception_classes()
    assert {"ConfigurationError", "MissingMessageIdError", "ClaimError"} <= classes
    missing = sorted(name for name in classes - INTERNAL if f"`{name}`" not in page)
    assert not missing, f"not on docs/troubleshooting.md: {missing}"
    stale = sorted(INTERNAL - classes)
    assert not stale, f"INTERNAL names classes that no longer exist: {stale}"
