#!/usr/bin/env bash
# The whole test suite, on a fresh machine or a warm one:
#   1. a virtualenv in .venv with mqdedup and every extra installed from PyPI,
#   2. the services the tests need started natively on loopback (scripts/services.sh),
#   3. ruff, mypy and lint-imports (the architecture's import contracts in pyproject.toml),
#      the documentation site (`mkdocs build --strict`: a broken link or reference fails),
#      then pytest (unit, integration, acceptance) and, in a full run,
#      beside it the unit tests on the declared minimum versions (scripts/min_versions.sh).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[all,test,dev]'

bash scripts/services.sh start postgres rabbitmq redis kafka mariadb pgbouncer pgbouncer-session
bash scripts/services.sh browser # Debian's chromium: the console's browser tests (Playwright)
eval "$(bash scripts/services.sh env)"

.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
site=$(mktemp -d)
# Not --quiet: it hides the warnings that --strict turns into a failure.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
rm -rf "$site"
min_pid=
if [[ $# -eq 0 ]]; then
    # A full run also proves the declared minimum versions (the unit tests in .venv-min),
    # alongside the main run: that one mostly waits on services, so this costs little.
    min_log=$(mktemp)
    bash scripts/min_versions.sh >"$min_log" 2>&1 &
    min_pid=$!
fi
status=0
.venv/bin/pytest "$@" || status=$?
if [[ -n $min_pid ]]; then
    # Silent when green, so that pytest's summary stays the run's closing line.
    if ! wait "$min_pid"; then
        echo "[min-versions] FAILED on the declared minimum versions:" >&2
        tail -n 40 "$min_log" >&2
        status=1
    fi
fi
exit "$status"
