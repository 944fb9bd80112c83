"""Three emulated hosts (network namespaces on a bridge): a coordinator on one and, on each of the others,
only the README's bare `swarm peer --join STRING --device cpu`. The peers must reach each other without
any address flag, commit every round and end on the same model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import TWO_PEER_RUN, kill_family, read_join_string
from tests.integration.netns_hosts import NetnsHosts, missing_privilege

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(90)]
ROOT = Path(__file__).resolve().parents[2]


def _start(hosts: NetnsHosts, host: int, args: list[str], *, cwd: Path, log: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    # one torch thread per peer: two peers share this machine's cores (the CLI stays the bare command)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "ab") as out:
        return subprocess.Popen(
            hosts.command(host, [sys.executable, "-m", "swarm.app.cli", *args]),
            cwd=cwd,
            env=env,
            stdout=out if not args[0] == "coordinator" else subprocess.PIPE,
            stderr=out,
        )


@pytest.fixture
def hosts():
    why = missing_privilege()
    if why:
        pytest.skip(f"needs network namespaces: {why}")
    with NetnsHosts(3) as made:
        yield made


def test_bare_peers_on_two_other_hosts_commit_every_round_and_end_identical(hosts, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(TWO_PEER_RUN)
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "peer-1", "peer-2")}
    try:
        coordinator = _start(
            hosts,
            0,
            [
                "coordinator",
                "--config",
                str(config),
                "--host",
                "0.0.0.0",
                "--announce-host",
                hosts.addresses[0],
                "--state-dir",
                str(tmp_path / "coordinator"),
                "--exit-grace-s",
                "0",
            ],
            cwd=tmp_path,
            log=logs["coordinator"],
        )
        procs.append(coordinator)
        join = read_join_string(coordinator, timeout_s=30, log=logs["coordinator"])
        assert join.startswith(f"swarm://{hosts.addresses[0]}:")
        for host in (1, 2):  # the README's first example, nothing more: default state dir in its own cwd
            procs.append(
                _start(
                    hosts,
                    host,
                    ["peer", "--join", join, "--device", "cpu"],
                    cwd=tmp_path / f"host{host}",
                    log=logs[f"peer-{host}"],
                )
            )
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
            kill_family(proc)


def test_peers_that_listen_on_loopback_are_told_the_fix_and_still_train_through_the_relay(hosts, tmp_path):
    """The old default (--p2p-host 127.0.0.1) on separate hosts: each peer warns at start that groupmates cannot
    reach it and what to pass; its groupmate's dial fails, and the round goes through the coordinator's relay
    instead of failing (swarm/net/link/relay.py), so both commit every round and end on the same model."""
    config = tmp_path / "run.toml"
    config.write_text(TWO_PEER_RUN)
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "peer-1", "peer-2")}
    try:
        procs.append(
            _start(
                hosts,
                0,
                [
                    "coordinator",
                    "--config",
                    str(config),
                    "--host",
                    "0.0.0.0",
                    "--announce-host",
                    hosts.addresses[0],
                    "--state-dir",
                    str(tmp_path / "coordinator"),
                    "--exit-grace-s",
                    "0",
                ],
                cwd=tmp_path,
                log=logs["coordinator"],
            )
        )
        join = read_join_string(procs[0], timeout_s=30, log=logs["coordinator"])
        for host in (1, 2):
            procs.append(
                _start(
                    hosts,
                    host,
                    ["peer", "--join", join, "--device", "cpu", "--p2p-host", "127.0.0.1"],
                    cwd=tmp_path / f"host{host}",
                    log=logs[f"peer-{host}"],
                )
            )
        for host, proc in zip((1, 2), procs[1:]):
            try:
                code = proc.wait(timeout=70)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, logs[f"peer-{host}"].read_text(errors="replace")[-3000:]
        for host in (1, 2):
            log = logs[f"peer-{host}"].read_text(errors="replace")
            assert (
                "--p2p-host 127.0.0.1 listens on this machine only" in log
                and "groupmates cannot reach this peer at /ip4/127.0.0.1/tcp/" in log
                and "pass --announce-host ADDRESS reachable from them (and open the port)" in log
            ), log[-3000:]
            assert "through the coordinator's relay" in log, log[-3000:]
            assert set(re.findall(r"r(\d+)\] committed, hash", log)) == {"1", "2"}, log[-3000:]
        finals = [tmp_path / f"host{h}" / "swarm-peer" / "final" / "model.safetensors" for h in (1, 2)]
        assert tensors_digest(finals[0]) == tensors_digest(finals[1]), "the peers ended on different models"
    finally:
        for proc in procs:
            kill_family(proc)
