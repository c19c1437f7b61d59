"""The real ``mqdedup`` command as a subprocess: the demo and bad input."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mqdedup.cli import exitcodes

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDEDUP, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_demo_passes_all_checks_in_under_a_minute() -> None:
    started = time.monotonic()
    result = run("demo")
    elapsed = time.monotonic() - started
    assert result.returncode == exitcodes.OK, result.stdout + result.stderr
    assert "✓ every unique order written exactly once" in result.stdout
    assert "✓ nothing lost" in result.stdout
    assert "✗" not in result.stdout
    assert "crashes survived" in result.stdout
    assert elapsed < 60


def test_demo_on_a_given_database_with_options(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    result = run("demo", "--messages", "300", "--duplicates", "0.5", "--database", url)
    assert result.returncode == 0, result.stderr
    assert "unique orders                            300" in result.stdout
    assert (tmp_path / "demo.db").exists()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["db", "init", "--database", "foo://x"],
            exitcodes.CONFIGURATION,
            "unknown database kind 'foo'",
        ),
        (
            ["db", "init", "--database", "::not a url::"],
            exitcodes.CONFIGURATION,
            "malformed database URL",
        ),
        (
            ["db", "init", "--database", "postgresql://u:s3cret@127.0.0.1:1/x"],
            exitcodes.DATABASE_UNAVAILABLE,
            "cannot connect to database postgresql+psycopg://u:***@127.0.0.1:1/x",
        ),
        (
            ["worker", "no.such.module:Consumer"],
            exitcodes.CONSUMER_IMPORT,
            "cannot import module 'no.such.module'",
        ),
        (
            ["worker", "json:dumps"],
            exitcodes.CONSUMER_IMPORT,
            "'json:dumps' is not a mqdedup Consumer",
        ),
        (["worker", "json"], exitcodes.CONSUMER_IMPORT, "must look like 'module.path:ClassName'"),
        (["demo", "--duplicates", "2"], exitcodes.USAGE, "--duplicates must be in [0, 1]"),
        (["dedup", "purge", "--older-than", "7x"], exitcodes.USAGE, "invalid duration '7x'"),
    ],
)
def test_bad_input_gets_one_clear_line_and_a_documented_exit_code(
    args: list[str], code: int, message: str
) -> None:
    result = run(*args)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "s3cret" not in result.stderr + result.stdout


def test_debug_shows_the_traceback() -> None:
    result = run("--debug", "worker", "no.such.module:Consumer")
    assert result.returncode == exitcodes.CONSUMER_IMPORT
    assert "Traceback" in result.stderr


def test_db_init_is_idempotent_and_check_passes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    first = run("db", "init", "--database", url)
    assert first.returncode == 0 and "created: mqdedup_processed_messages" in first.stdout
    second = run("db", "init", "--database", url)
    assert second.returncode == 0 and "up to date" in second.stdout
    check = run("db", "check", "--database", url)
    assert check.returncode == 0 and "matches" in check.stdout
    missing = run("db", "check", "--database", f"sqlite:///{tmp_path / 'empty.db'}")
    assert missing.returncode == exitcodes.CHECK_FAILED and "is missing" in missing.stdout
