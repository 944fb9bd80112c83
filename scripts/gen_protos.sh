#!/usr/bin/env bash
# Regenerate the Python code for protos/ (committed; tests/unit/test_protos_current.py fails when stale).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p swarm/v1
"$PY" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/swarm/v1/*.proto
touch swarm/v1/__init__.py
