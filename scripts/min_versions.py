"""Print the lowest versions pyproject.toml allows, one pip requirement per line.

Every runtime dependency (the core and the extras in ``all``) is pinned to its ``>=``
floor; the test tools (the ``test`` extra) are printed as declared, except those only
the integration and acceptance tests use. Used by
``scripts/min_versions.sh``, so a declared floor is a tested floor.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

RUNTIME_EXTRAS = (
    "postgresql", "kafka", "rabbitmq", "redis", "mysql", "otel", "asyncio", "fastapi", "django",
    "pydantic", "msgspec",
)
#: Test tools only the integration and acceptance tests use (the browser, the FastStream and
#: Celery examples): left out here, where the unit tests run, since their own floors
#: conflict with the runtime floors (playwright needs a newer greenlet than 3.0).
NOT_FOR_UNIT_TESTS = ("playwright", "faststream", "celery")
_REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+(?:\[[^\]]+\])?)\s*(?P<spec>.*)$")


def floor_pin(requirement: str) -> str:
    """``name[extra]>=X,<Y`` -> ``name[extra]==X``; fails if there is no ``>=`` floor."""
    match = _REQUIREMENT.match(requirement.strip())
    if match is None:
        raise SystemExit(f"cannot parse requirement {requirement!r}")
    floors = [part[2:].strip() for part in match["spec"].split(",") if part.strip()[:2] == ">="]
    if not floors:
        raise SystemExit(f"requirement {requirement!r} declares no '>=' floor")
    return f"{match['name']}=={floors[0]}"


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    project = tomllib.loads(path.read_text())
    metadata = project["project"]
    extras = metadata["optional-dependencies"]
    runtime = list(metadata["dependencies"])
    for extra in RUNTIME_EXTRAS:
        runtime.extend(extras[extra])
    for requirement in runtime:
        if requirement.startswith(f"{metadata['name']}["):
            continue  # an extra naming other extras of this project (listed on their own)
        print(floor_pin(requirement))
    for requirement in extras["test"]:
        if not requirement.startswith(NOT_FOR_UNIT_TESTS):
            print(requirement)


if __name__ == "__main__":
    main()
