#!/usr/bin/env bash
# The benchmark suite: starts the services it needs, then `python -m bench` with the
# arguments given (e.g. `scripts/bench.sh --quick`). Results go to bench/results/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -x .venv/bin/python ]]; then
    echo "bench.sh: no .venv (run scripts/test.sh or: python3 -m venv .venv && .venv/bin/pip install -e '.[all,bench]')" >&2
    exit 2
fi
if ! .venv/bin/python -c 'import matplotlib' 2>/dev/null; then
    .venv/bin/python -m pip install --quiet -e '.[all,bench]'
fi
bash scripts/services.sh start postgres rabbitmq kafka
eval "$(bash scripts/services.sh env)"
exec .venv/bin/python -m bench "$@"
