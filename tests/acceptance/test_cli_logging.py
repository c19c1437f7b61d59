"""Log level and format from flag, environment or TOML; the health endpoint's address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from mqdedup.cli import exitcodes
from tests.acceptance.test_cli_edges import MQDEDUP, cli
from tests.services import REPO, free_port, require_service, wait_for


def _sqlite(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert cli("db", "init", "--database", url).returncode == 0
    return url


def test_log_level_and_format_come_from_the_environment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    done = cli(
        "db",
        "init",
        "--database",
        url,
        env={"MQDEDUP_LOG_LEVEL": "info", "MQDEDUP_LOG_FORMAT": "json"},
    )
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert entries, done.stderr
    assert all({"time", "level", "logger", "message"} <= set(entry) for entry in entries)


def test_log_level_from_toml_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    url = _sqlite(tmp_path)
    config = tmp_path / "mqdedup.toml"
    config.write_text('[mqdedup]\nlog_level = "BOGUS"\n')
    bad = cli("db", "check", "--database", url, "--config", str(config))
    assert bad.returncode == exitcodes.CONFIGURATION
    assert bad.stderr.count("\n") == 1 and "BOGUS" in bad.stderr and "Traceback" not in bad.stderr
    config.write_text('[mqdedup]\nlog_level = "INFO"\nlog_format = "json"\n')
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    good = cli("db", "init", "--database", fresh, "--config", str(config))
    assert good.returncode == 0 and good.stderr.lstrip().startswith("{"), good.stderr
    # The flag wins over the file.
    quiet = cli("db", "check", "--database", url, "--config", str(config), "--log-level", "ERROR")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_the_health_endpoint_binds_the_given_address(tmp_path: Path) -> None:
    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    if not bootstrap:
        require_service("Kafka", "MQDEDUP_KAFKA_BOOTSTRAP is not set")
    url = _sqlite(tmp_path)
    port = free_port()
    worker = subprocess.Popen(
        [
            MQDEDUP,
            "relay",
            "--database",
            url,
            "--kafka-bootstrap",
            str(bootstrap),
            "--health-port",
            str(port),
            "--health-host",
            "127.0.0.1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/live", timeout=2):
                    return True
            except OSError:
                return worker.poll() is not None  # died: fail below with its output

        wait_for(answers, 60, "the health endpoint")
        assert worker.poll() is None, worker.communicate()[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert b"mqdedup_build_info" in reply.read()
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            time.sleep(0.1)
