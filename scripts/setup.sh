#!/usr/bin/env bash
# Create .venv (if missing) and install Swarm with its test, Hugging Face and TensorBoard extras. Idempotent; safe to run twice.
# torch is pinned to the CPU build that every project machine has on local disk; a newer torch or an
# open range with no torch installed would pull a multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${SWARM_TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION" >&2
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
stamp=.venv/.swarm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing swarm and its dependencies" >&2
  # hf: Hugging Face models, tokenizers and export; tensorboard: [logging] tensorboard (their tests need them)
  "${PIP[@]}" install -e ".[dev,hf,tensorboard]"
  touch "$stamp"
fi
# Install Debian packages; a fresh machine may have no package lists yet: fetch them once and retry.
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
  apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1
}
# The dashboard's browser test drives Debian's chromium (playwright, with no browser download of its own).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
  echo "setup: installing chromium for the dashboard's browser test" >&2
  apt_install chromium \
    || echo "setup: could not install chromium; the dashboard's browser test will skip" >&2
fi
# The WAN testbed (scripts/testbed, its tests) shapes links with iproute2 and builds its NAT host with
# iptables. As root on a Debian machine without them, install them; elsewhere those tests skip and say why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]} for the WAN testbed" >&2
    apt_install "${missing[@]}" \
      || echo "setup: could not install ${missing[*]}; the WAN testbed's tests will skip" >&2
  fi
fi
