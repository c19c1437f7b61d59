#!/usr/bin/env bash
# The declared minimum versions, tested: installs every runtime dependency at the floor
# pyproject.toml declares (scripts/min_versions.py) into .venv-min and runs the unit tests
# there. Part of scripts/test.sh; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv-min/bin/python ]]; then
    "$PYTHON" -m venv .venv-min
fi
mapfile -t pins < <("$PYTHON" scripts/min_versions.py)
echo "[min-versions] ${pins[*]}" >&2
.venv-min/bin/python -m pip install --quiet --upgrade pip
.venv-min/bin/python -m pip install --quiet "${pins[@]}"
.venv-min/bin/python -m pip install --quiet --no-deps -e .
exec .venv-min/bin/python -m pytest tests/unit -q -p no:cacheprovider "$@"
