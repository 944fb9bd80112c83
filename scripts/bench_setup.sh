#!/usr/bin/env bash
# Install the optional `bench` extra (torchft, the external DiLoCo reference for
# scripts/bench_quality.py) into .venv without ever replacing its torch build.
#
#   scripts/bench_setup.sh            # idempotent; run scripts/setup.sh first
#
# torchft 0.2.0 declares torch>=2.7 plus three opentelemetry packages (its __init__ imports them).
# A dry run first lists what pip would install; if that list holds torch (a multi-gigabyte CUDA
# build) or protobuf (pinned by Swarm's generated code), torchft is installed with --no-deps plus
# only the opentelemetry packages, each also with its protected packages left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCHFT_VERSION=${SWARM_TORCHFT_VERSION:-0.2.0}
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "bench_setup: .venv is missing; run scripts/setup.sh first." >&2
  exit 1
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)

if "$PY" -c "import torchft, sys; sys.exit(torchft.__version__ != '$TORCHFT_VERSION' if hasattr(torchft, '__version__') else 0)" 2>/dev/null; then
  echo "bench_setup: torchft already importable; nothing to do." >&2
  exit 0
fi

torch_before=$("$PY" -c "import torch; print(torch.__version__)")
report=$(mktemp)
trap 'rm -f "$report"' EXIT
"${PIP[@]}" install --dry-run --report "$report" "torchft==$TORCHFT_VERSION" >/dev/null
would_replace=$("$PY" - "$report" <<'EOF'
import json, sys
names = [i["metadata"]["name"].lower() for i in json.load(open(sys.argv[1]))["install"]]
print(" ".join(n for n in names if n in ("torch", "protobuf", "numpy")))
EOF
)

if [ -z "$would_replace" ]; then
  echo "bench_setup: installing torchft==$TORCHFT_VERSION (torch $torch_before stays)" >&2
  "${PIP[@]}" install "torchft==$TORCHFT_VERSION"
else
  echo "bench_setup: torchft's dependencies would replace: $would_replace; installing with --no-deps" >&2
  "${PIP[@]}" install --no-deps "torchft==$TORCHFT_VERSION"
  # What torchft imports at `import torchft` besides torch; their own deps are small pure-Python
  # packages (requests, googleapis-common-protos, ...), but they must not move protobuf either.
  "${PIP[@]}" install "opentelemetry-api>=1.39.0" "opentelemetry-sdk>=1.39.0" \
    "opentelemetry-exporter-otlp-proto-http>=1.39.0" "protobuf==$("$PY" -c 'import google.protobuf as p; print(p.__version__)')"
fi

torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_after" != "$torch_before" ]; then
  echo "bench_setup: torch changed from $torch_before to $torch_after; reinstall torch==$torch_before." >&2
  exit 1
fi
"$PY" -c "import torchft; from torchft._torchft import LighthouseServer" \
  && echo "bench_setup: torchft ready (torch $torch_after)." >&2
