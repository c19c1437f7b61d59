"""Issue #40's small CLI items, the real ``mqdedup`` command as a subprocess (no broker:
the unreachable one is a closed local port; the database is a SQLite file):

* a duration too long for a date (``dedup purge --older-than 99999999d``) is one line,
  exit code 2, no traceback;
* a negative or non-finite shutdown timeout (flag or environment) is refused: one line,
  exit code 3;
* Ctrl-C at any moment of the start-up (the first second: importing the framework,
  building the parser, checking the database, waiting for the broker) ends the command
  without a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine, init_schema
from tests.services import REPO, TERMINAL_SIGNALS

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
RABBIT = "tests.acceptance.edge_consumers:Rabbit"


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MQDEDUP_")}
    url = f"sqlite:///{tmp_path / 'limits.db'}"
    engine = create_engine(url)
    init_schema(engine)
    engine.dispose()
    env.update(
        PYTHONPATH=str(REPO),
        MQDEDUP_DATABASE_URL=url,
        MQDEDUP_RUNTIME_DIR=str(tmp_path / "run"),
        EDGE_TIMEOUT="30",
        **extra,
    )
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDEDUP, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1 and text in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("older_than", ["99999999d", "99999999999d", "99999999999999999999w"])
def test_a_duration_too_long_is_one_line_with_exit_code_2(tmp_path: Path, older_than: str) -> None:
    result = run(environment(tmp_path), "dedup", "purge", "--older-than", older_than, "--yes")
    assert_one_line(result, exitcodes.USAGE, f"duration '{older_than}' is too long")


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["worker", RABBIT, "--shutdown-timeout", "-5"], {}),
        (["relay", "--shutdown-timeout", "-5"], {"MQDEDUP_RABBITMQ_URL": "amqp://127.0.0.1:1/"}),
        (["worker", RABBIT], {"MQDEDUP_SHUTDOWN_TIMEOUT": "-1"}),
        (["worker", RABBIT, "--shutdown-timeout", "nan"], {}),
        (["worker", RABBIT, "--shutdown-timeout", "inf"], {}),
    ],
)
def test_a_negative_or_infinite_shutdown_timeout_is_refused(
    tmp_path: Path, args: list[str], extra: dict[str, str]
) -> None:
    result = run(environment(tmp_path, **extra), *args)
    assert_one_line(result, exitcodes.CONFIGURATION, "--shutdown-timeout must be")


@pytest.mark.parametrize("after", [0.15, 0.3, 0.45, 0.6, 0.75, 1.0])
def test_ctrl_c_during_start_up_prints_no_traceback(tmp_path: Path, after: float) -> None:
    env = environment(tmp_path)
    worker = subprocess.Popen(
        [*TERMINAL_SIGNALS, MQDEDUP, "worker", RABBIT],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(after)  # the moment of the Ctrl-C is what this test varies
        worker.send_signal(signal.SIGINT)
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "Traceback" not in err + out, err
    assert "KeyboardInterrupt" not in err, err
    # Interrupted (130), or stopped while waiting for the broker (0): never killed by it.
    assert worker.returncode in (exitcodes.INTERRUPTED, exitcodes.OK), err
