"""Three emulated hosts (network namespaces on a bridge): a coordinator on one and, on each of the others,
only the README's bare `swarm peer --join STRING --device cpu`. The peers must reach each other without
any address flag, commit every round and end on the same model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from swarm.train.final_model import tensors_digest
from tests.integration.netns_hosts import NetnsHosts, missing_privilege

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
ROOT = Path(__file__).resolve().parents[2]

TINY_RUN = """
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


def _start(hosts: NetnsHosts, host: int, args: list[str], *, cwd: Path, log: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    # one torch thread per peer: two peers share this machine's cores (the CLI stays the bare command)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "ab") as out:
        return subprocess.Popen(hosts.command(host, [sys.executable, "-m", "swarm.app.cli", *args]),
                                cwd=cwd, env=env, stdout=out if not args[0] == "coordinator" else subprocess.PIPE,
                                stderr=out)


def _kill(proc: subprocess.Popen) -> None:
    """The process and its DHT child with its p2pd, which would otherwise outlive the namespace."""
    if proc.poll() is not None:
        return
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


def _join_string(coordinator: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = coordinator.stdout.readline().decode()
        if line.startswith("join: "):
            return line.split(" ", 1)[1].strip()
        if not line and coordinator.poll() is not None:
            break
    raise AssertionError(f"the coordinator printed no join string:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture
def hosts():
    why = missing_privilege()
    if why:
        pytest.skip(f"needs network namespaces: {why}")
    with NetnsHosts(3) as made:
        yield made


def test_bare_peers_on_two_other_hosts_commit_every_round_and_end_identical(hosts, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(TINY_RUN)
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "peer-1", "peer-2")}
    try:
        coordinator = _start(hosts, 0, ["coordinator", "--config", str(config), "--host", "0.0.0.0",
                                        "--announce-host", hosts.addresses[0], "--state-dir",
                                        str(tmp_path / "coordinator"), "--exit-grace-s", "0"],
                             cwd=tmp_path, log=logs["coordinator"])
        procs.append(coordinator)
        join = _join_string(coordinator, logs["coordinator"], timeout_s=30)
        assert join.startswith(f"swarm://{hosts.addresses[0]}:")
        for host in (1, 2):  # the README's first example, nothing more: default state dir in its own cwd
            procs.append(_start(hosts, host, ["peer", "--join", join, "--device", "cpu"],
                                cwd=tmp_path / f"host{host}", log=logs[f"peer-{host}"]))
        for name, proc in zip(("peer-1", "peer-2"), procs[1:]):
            try:
                code = proc.wait(timeout=70)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"{name} exited with {code}:\n{logs[name].read_text(errors='replace')[-4000:]}"
        for host in (1, 2):
            log = logs[f"peer-{host}"].read_text(errors="replace")
            assert f"reachable for groupmates at /ip4/{hosts.addresses[host]}/tcp/" in log, log[-3000:]
            committed = set(re.findall(r"r(\d+)\] committed, hash", log))
            assert committed == {"1", "2"}, f"peer-{host} committed rounds {sorted(committed)}:\n{log[-3000:]}"
            assert "exchange failed" not in log, log[-3000:]
        finals = [tmp_path / f"host{h}" / "swarm-peer" / "final" / "model.safetensors" for h in (1, 2)]
        assert tensors_digest(finals[0]) == tensors_digest(finals[1]), "the peers ended on different models"
    finally:
        for proc in procs:
            _kill(proc)


def test_peers_that_listen_on_loopback_say_why_their_rounds_fail_and_what_to_pass(hosts, tmp_path):
    """The old default (--p2p-host 127.0.0.1) on separate hosts: each peer warns at start, and the failed
    round's reason, in the peer's log and the coordinator's, names the unreachable groupmate and the fix."""
    config = tmp_path / "run.toml"
    config.write_text(TINY_RUN)
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "peer-1", "peer-2")}
    try:
        procs.append(_start(hosts, 0, ["coordinator", "--config", str(config), "--host", "0.0.0.0",
                                       "--announce-host", hosts.addresses[0], "--state-dir",
                                       str(tmp_path / "coordinator")], cwd=tmp_path, log=logs["coordinator"]))
        join = _join_string(procs[0], logs["coordinator"], timeout_s=30)
        for host in (1, 2):
            procs.append(_start(hosts, host, ["peer", "--join", join, "--device", "cpu", "--p2p-host", "127.0.0.1"],
                                cwd=tmp_path / f"host{host}", log=logs[f"peer-{host}"]))
        deadline = time.monotonic() + 60
        while "cannot reach groupmate" not in logs["coordinator"].read_text(errors="replace"):
            assert time.monotonic() < deadline, logs["peer-1"].read_text(errors="replace")[-3000:]
            assert all(p.poll() is None for p in procs), logs["peer-1"].read_text(errors="replace")[-3000:]
            time.sleep(0.2)  # polling the coordinator's log: nothing to await
        for host in (1, 2):
            log = logs[f"peer-{host}"].read_text(errors="replace")
            assert ("--p2p-host 127.0.0.1 listens on this machine only" in log
                    and "groupmates cannot reach this peer at /ip4/127.0.0.1/tcp/" in log
                    and "pass --announce-host ADDRESS reachable from them (and open the port)" in log), log[-3000:]
        assert "that peer must pass --announce-host" in logs["coordinator"].read_text(errors="replace")
    finally:
        for proc in procs:
            _kill(proc)
