"""Under ``CI=true`` no promise's test may skip: a missing service or a module of an
installed extra fails the run there (``tests/services.py``: ``require_service``,
``require_module``); the only skips left are listed and say why."""

from __future__ import annotations

import re

import pytest

from tests import services
from tests.services import REPO, require_module

#: Where ``pytest.skip`` may be called, and why.
ALLOWED_SKIP_CALLS = {
    "tests/services.py": "require_service / require_module: skip locally, fail in CI",
    "tests/acceptance/test_docs_commands.py": (
        "documentation blocks annotated `docs-test: skip`, one to one with ALLOWED_SKIPS"
    ),
}


def test_a_missing_module_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="no_such_module_39"):
        require_module("no_such_module_39")
    monkeypatch.setattr(services, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="required in CI"):
        require_module("no_such_module_39")


def test_only_the_listed_modules_may_be_missing_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "IN_CI", True)
    monkeypatch.setitem(services.CI_OPTIONAL_MODULES, "no_such_module_39", "a test's reason")
    with pytest.raises(pytest.skip.Exception, match="a test's reason"):
        require_module("no_such_module_39.sub")
    assert require_module("json").dumps([]) == "[]"


def test_no_test_skips_around_the_ci_policy() -> None:
    """``pytest.importorskip`` and ``skipif`` skip in CI too; ``pytest.skip`` is called
    only where :data:`ALLOWED_SKIP_CALLS` says."""
    offenders = []
    pattern = re.compile(r"pytest\.importorskip\(|mark\.skipif\(|mark\.skip\(|pytest\.skip\(")
    for path in sorted((REPO / "tests").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative == "tests/unit/test_skip_policy.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not (
                "pytest.skip(" in line and relative in ALLOWED_SKIP_CALLS
            ):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "use tests.services.require_module / require_service:\n" + "\n".join(
        offenders
    )
