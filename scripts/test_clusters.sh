#!/usr/bin/env bash
# The broker-cluster tests (issue 31), apart from the main suite because they take minutes
# and most of a 2-core machine: a three-broker Kafka and a three-node RabbitMQ lose nodes
# (kill -9) under real workers and relays (tests/integration/clusters/).
#
#   scripts/test_clusters.sh            # after scripts/test.sh (CI: .ci/run), or alone
#   scripts/test_clusters.sh -k kafka   # extra arguments go to pytest
#
# Works on a fresh machine: the virtualenv and PostgreSQL as scripts/test.sh makes them;
# each test module starts its cluster (scripts/services.sh start kafka-cluster /
# rabbitmq-cluster) and stops it at its end. The shared single-node brokers are not touched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import mqdedup, kafka, pika, pytest' 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[all,test,dev]'
fi

bash scripts/services.sh start postgres
eval "$(bash scripts/services.sh env)"

MQDEDUP_TEST_CLUSTERS=1 exec .venv/bin/pytest tests/integration/clusters -p no:cacheprovider "$@"
