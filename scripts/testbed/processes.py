"""Processes of a swarm on one machine: the join string a coordinator prints, and a process killed with its
children (its DHT process and p2pd). Shared by the benchmarks in scripts/ and the integration tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import psutil

# Two peers, two short rounds of the tiny model: the runs across emulated hosts (min_peers set to the hosts' count
# where more run).
TWO_PEER_RUN = """
[model]
preset = "tiny"

[rounds]
inner_steps = 5
max_rounds = 2
min_peers = 2
matchmaking_window_s = 10.0
exchange_timeout_s = 10.0
round_timeout_s = 30.0
"""


def read_join_string(coordinator: Any, *, timeout_s: float, log: Optional[Path] = None) -> str:
    """The join string a coordinator started with stdout=PIPE prints (``coordinator`` has ``stdout.readline()``
    and ``poll()``, as a ``subprocess.Popen``); fails (with its log) if it prints none."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = coordinator.stdout.readline().decode()
        if line.startswith("join: "):
            return line.split(" ", 1)[1].strip()
        if not line and coordinator.poll() is not None:
            break
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"the coordinator printed no join string:\n{tail}")


def kill_family(proc: Any) -> None:
    """The process (anything with a ``pid``) and its children (its DHT process and p2pd, which would otherwise
    outlive it)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
