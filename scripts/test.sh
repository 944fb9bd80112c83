#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite. Extra arguments go to pytest (one plain run).
#
# The whole suite runs on two pytest workers (pytest-xdist): most of its time is real peer processes that
# wait on each other, which a second worker fills. Tests marked `serial` measure times or link rates, so
# they run afterwards, alone.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
status=0
"${PYTEST[@]}" -n "${SWARM_TEST_WORKERS:-2}" -m "not serial" || status=$?
"${PYTEST[@]}" -m serial || status=$((status ? status : $?))
exit "$status"
