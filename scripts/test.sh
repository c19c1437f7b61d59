#!/usr/bin/env bash
# The whole test suite, on a fresh machine or a warm one:
#   1. a virtualenv in .venv with mqdedup and every extra installed from PyPI,
#   2. the services the tests need started natively on loopback (scripts/services.sh),
#   3. ruff and mypy, the unit tests on the declared minimum versions
#      (scripts/min_versions.sh, full runs only), then pytest (unit, integration, acceptance).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[all,test,dev]'

bash scripts/services.sh start postgres rabbitmq redis kafka mariadb
eval "$(bash scripts/services.sh env)"

.venv/bin/ruff check .
.venv/bin/mypy
if [[ $# -eq 0 ]]; then
    # The full run also proves the declared minimum versions (unit tests, ~1-2 min).
    bash scripts/min_versions.sh
fi
exec .venv/bin/pytest "$@"
