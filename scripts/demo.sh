#!/usr/bin/env bash
# Set everything up (idempotent), then run `swarm demo`: a coordinator and 3 peers on this machine.
# Extra arguments go to `swarm demo` (e.g. --rounds 5 --json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/swarm demo "$@"
