"""A missing optional dependency: the ImportError names the extra to install.

Each case runs in a fresh interpreter with the package hidden (``sys.modules[name] =
None`` makes ``import name`` fail as if it were not installed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (
        "kafka",
        "import mqdedup.kafka",
        "mqdedup.kafka needs kafka-python: pip install 'mqdedup[kafka]'",
    ),
    ("kafka", "from mqdedup.kafka.consumer import KafkaConsumer", "pip install 'mqdedup[kafka]'"),
    (
        "pika",
        "import mqdedup.rabbitmq",
        "mqdedup.rabbitmq needs pika: pip install 'mqdedup[rabbitmq]'",
    ),
    ("redis", "import mqdedup.dedup.redis_claims", "needs redis: pip install 'mqdedup[redis]'"),
    ("redis", "import mqdedup.locks.redis_lock", "needs redis: pip install 'mqdedup[redis]'"),
    (
        "django",
        "import mqdedup.django",
        "mqdedup.django needs django: pip install 'mqdedup[django]'",
    ),
    (
        "fastapi",
        "import mqdedup.fastapi",
        "mqdedup.fastapi needs fastapi: pip install 'mqdedup[fastapi]'",
    ),
]


def run_python(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *arguments], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(("module", "statement", "expected"), CASES)
def test_the_import_error_names_the_extra(module: str, statement: str, expected: str) -> None:
    result = run_python("-c", f"import sys; sys.modules[{module!r}] = None\n{statement}")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and expected in last, result.stderr
    assert "No module named" not in result.stderr  # the bare error is not shown


def test_the_core_imports_without_any_extra() -> None:
    hidden = "; ".join(
        f"sys.modules[{name!r}] = None"
        for name in ("kafka", "pika", "redis", "django", "fastapi", "pydantic", "msgspec")
    )
    result = run_python("-c", f"import sys; {hidden}\nimport mqdedup\nprint(mqdedup.Consumer)")
    assert result.returncode == 0, result.stderr
    assert "mqdedup.consumers.base.Consumer" in result.stdout


def test_importing_the_kafka_adapter_warns_nothing() -> None:
    """kafka-python's own 218 DeprecationWarnings at import (importlib.resources on
    Python 3.11/3.12) no longer reach the user's process through mqdedup.kafka."""
    result = run_python("-W", "error::DeprecationWarning", "-c", "import mqdedup.kafka")
    assert result.returncode == 0, result.stderr[-2000:]
