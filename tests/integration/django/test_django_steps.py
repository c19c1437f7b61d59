"""``ctx.step`` with Django on real PostgreSQL and MariaDB (in-memory broker).

The step's record must commit on its own, not in a savepoint of the message's atomic
block: a message that fails after its step, retried until dead-lettered, and its
batch-mates (rerun with it in ``rerun`` mode) call the third party once per message,
in every failure-isolation mode. Inside an atomic block opened before the worker's
(pytest-django's test transaction) the records stay in that block and vanish with it.
The scenarios (``steps_scenarios.py``) run in a pytest process of their own with the
example project's settings, as ``test_django_faults.py`` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.django.support import PYTHON, example_env, fresh_database, migrated, run

pytestmark = pytest.mark.integration
SCENARIOS = Path(__file__).with_name("steps_scenarios.py")


@pytest.mark.parametrize("server", ["pg_url", "mariadb_url"])
def test_django_steps_call_once_per_message(server: str, request: pytest.FixtureRequest) -> None:
    with fresh_database(request.getfixturevalue(server)) as database_url:
        env = example_env(database_url)
        migrated(database_url, env)
        result = run(
            PYTHON,
            "-m",
            "pytest",
            str(SCENARIOS),
            "-p",
            "no:django",
            "-p",
            "no:cacheprovider",
            "-q",
            env=env,
            timeout=240,
        )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "5 passed" in result.stdout, result.stdout[-3000:]
