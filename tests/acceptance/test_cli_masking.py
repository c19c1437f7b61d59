"""The real ``mqdedup`` command never prints a password, wherever the URL carries it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from mqdedup.cli import exitcodes

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MQDEDUP_")}
    return subprocess.run(
        [MQDEDUP, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


@pytest.mark.parametrize(
    ("command", "url"),
    [
        (["status"], "postgresql://app@127.0.0.1:1/app?password=S3cretPW"),
        (["status"], "postgresql://app:S3c@retPW@127.0.0.1:1/app"),
        (["db", "check"], "postgresql://app@127.0.0.1:1/app?sslmode=disable&sslpassword=S3cretPW"),
        (["outbox", "status"], "mysql+pymysql://app:S3c@retPW@127.0.0.1:1/app"),
    ],
)
def test_unreachable_database_errors_hide_the_password(command: list[str], url: str) -> None:
    result = run("--debug", *command, "--database", url)
    assert result.returncode == exitcodes.DATABASE_UNAVAILABLE, result.stderr
    assert "cannot connect to database" in result.stderr
    assert "S3cretPW" not in result.stdout + result.stderr
    assert "retPW" not in result.stdout + result.stderr


@pytest.mark.integration
def test_a_refused_login_on_real_postgresql_hides_the_password(pg_url: str) -> None:
    url = make_url(pg_url)
    wrong = url.set(password="S3c@retPW").render_as_string(hide_password=False)
    # The same URL with the @ unescaped, as a user would type it.
    wrong = wrong.replace("S3c%40retPW", "S3c@retPW")
    result = run("status", "--database", wrong)
    assert result.returncode == exitcodes.DATABASE_UNAVAILABLE, result.stderr
    assert "password authentication failed" in result.stderr  # the @ did not split the host
    assert "retPW" not in result.stdout + result.stderr
