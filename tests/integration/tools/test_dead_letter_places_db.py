"""The database dead-letter place on PostgreSQL: list / show / delete by row id, replay
twice through the claims (effects once), and the CLI's show / replay / requeue / delete."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from tests.unit import test_dead_letter_places as places

pytestmark = pytest.mark.integration


def test_the_database_place_on_postgresql(pg_engine: Engine) -> None:
    places.test_the_database_place_lists_gets_counts_and_deletes_by_row_id(pg_engine)


def test_replaying_twice_runs_effects_once_on_postgresql(pg_engine: Engine) -> None:
    places.test_replaying_database_dead_letters_twice_runs_effects_once(pg_engine)


def test_the_cli_on_the_database_place(pg_engine: Engine) -> None:
    for number in range(3):
        places._park(pg_engine, "orders", number)
    url = pg_engine.url.render_as_string(hide_password=False)
    keys = [r.key for r in places.DatabaseDeadLetters(pg_engine).list()]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "mqdedup.cli.main", *args, "--database", url],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert "Traceback" not in result.stderr, result.stderr
        return result

    shown = cli("dead-letters", "show", keys[0])
    assert shown.returncode == exitcodes.OK, shown.stderr
    assert "message id: m0" in shown.stdout and "broker refusal: MessageSizeTooLargeError" in (
        shown.stdout
    )
    assert '{"order": 0, "amount": 0}' in shown.stdout
    assert cli("dead-letters", "show", "x").returncode == exitcodes.USAGE
    refused = cli("dead-letters", "requeue", "--key", keys[0])
    assert refused.returncode == exitcodes.CONFIGURATION and "replay" in refused.stderr

    consumer = "tests.unit.test_dead_letter_places:Orders"
    replayed = cli("dead-letters", "replay", consumer, "--id", keys[0])
    assert replayed.returncode == exitcodes.OK, replayed.stderr
    assert "1 processed" in replayed.stdout and places._order_rows(pg_engine) == 1
    grouped = cli("dead-letters", "list", "--groups")
    assert "ValueError: no" in grouped.stdout and " 2 " in grouped.stdout
    deleted = cli("dead-letters", "delete", "--key", keys[1])
    assert deleted.returncode == exitcodes.OK and "deleted 1" in deleted.stdout
    everything = cli("dead-letters", "replay", consumer)
    assert "1 processed" in everything.stdout and places._order_rows(pg_engine) == 2
    assert "no dead letters" in cli("dead-letters", "list").stdout
