#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite. Extra arguments go to pytest (one plain run).
#   ./scripts/test.sh --lint          ruff check . and ruff format --check . (rules in pyproject.toml): non-zero on findings
#   ./scripts/test.sh --fast [ARGS]   the tests not marked slow or serial, on two workers (about a minute on 2 cores)
#
# The whole suite runs on three pytest workers (pytest-xdist), also on 2 cores: much of its time is real peer
# processes waiting on each other, which the other workers fill (measured on 2 idle cores: 1 worker 13:23,
# 2 workers 10:36, 3 workers 9:45, setup included). Tests marked `serial` measure times or link rates, so
# they run afterwards, alone.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
case "${1:-}" in
  --lint) .venv/bin/ruff check . && exec .venv/bin/ruff format --check . ;;
  --fast) shift; exec "${PYTEST[@]}" -n "${SWARM_TEST_WORKERS:-2}" -m "not slow and not serial" "$@" ;;
esac
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
status=0
"${PYTEST[@]}" -n "${SWARM_TEST_WORKERS:-3}" -m "not serial" --durations=25 || status=$?
"${PYTEST[@]}" -m serial || status=$((status ? status : $?))
exit "$status"
