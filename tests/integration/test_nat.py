"""Two peers behind NAT (the testbed's `nat` and `nat1` hosts, each behind a MASQUERADE router of its own that
admits nothing inbound) join with the bare `swarm peer --join STRING --device cpu` beside a public peer; all
three commit every round and end on the same model. No port forwarding, no VPN: a NAT peer dials the public
groupmate itself, and libp2p carries that groupmate's slices back over the connection; the two NAT peers can dial
neither way, so their slices go through the coordinator's relay (swarm.net.link.relay)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testbed import Testbed, make_topology, missing_privileges

from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import TWO_PEER_RUN, kill_family, read_join_string

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]
PEERS = ("h1", "nat", "nat1")
PREFIX = "swnat-"  # every namespace of this test; teardown removes only these


def _nat_holds(bed: Testbed, source: str, target: str) -> bool:
    """``source`` cannot reach ``target`` at all (a refused connection would mean it can, on a closed port)."""
    probe = (
        f"import socket\ns = socket.socket(); s.settimeout(2)\n"
        f"try: s.connect(({bed.address(target)!r}, 9)); print('reached')\n"
        f"except ConnectionRefusedError: print('reached')\nexcept OSError: print('unreachable')"
    )
    return (
        bed.run(source, [sys.executable, "-c", probe], capture_output=True, text=True, timeout=20).stdout.strip()
        == "unreachable"
    )


@pytest.fixture
def bed():
    why = missing_privileges(nat=True)
    if why:
        pytest.skip(why)
    with Testbed(make_topology(hosts=2, nat_hosts=2, prefix=PREFIX)) as made:
        yield made


def test_bare_peers_behind_two_nats_commit_every_round_through_the_relay_and_end_on_the_committed_model(bed, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(TWO_PEER_RUN.replace("min_peers = 2", f"min_peers = {len(PEERS)}"))
    # one torch thread per process: three share this machine's cores (the CLI stays the bare command)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).resolve().parents[2])
    )
    for source, target in (("h1", "nat"), ("nat", "nat1"), ("nat1", "nat")):
        assert _nat_holds(bed, source, target), f"{source} can reach {target}: the testbed's NAT is not in place"
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", *PEERS)}
    try:
        with open(logs["coordinator"], "wb") as err:
            procs.append(
                bed.spawn(
                    "h0",
                    [
                        sys.executable,
                        "-m",
                        "swarm.app.cli",
                        "coordinator",
                        "--config",
                        str(config),
                        "--host",
                        "0.0.0.0",
                        "--announce-host",
                        bed.address("h0"),
                        "--state-dir",
                        str(tmp_path / "coordinator"),
                        "--exit-grace-s",
                        "0",
                    ],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            )
        join = read_join_string(procs[0], timeout_s=30)
        for host in PEERS:  # the README's bare command, each in a directory of its own
            (tmp_path / host).mkdir()
            with open(logs[host], "wb") as out:
                procs.append(
                    bed.spawn(
                        host,
                        [sys.executable, "-m", "swarm.app.cli", "peer", "--join", join, "--device", "cpu"],
                        cwd=tmp_path / host,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        for host, proc in zip(PEERS, procs[1:]):
            try:
                code = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"{host}'s peer exited with {code}:\n{logs[host].read_text(errors='replace')[-4000:]}"
        hashes = {}
        for host in PEERS:
            log = logs[host].read_text(errors="replace")
            committed = dict(re.findall(r"r(\d+)\] committed, hash ([0-9a-f]+)", log))
            assert set(committed) == {"1", "2"}, f"{host} committed rounds {sorted(committed)}:\n{log[-3000:]}"
            hashes[host] = committed["2"]
        coordinator_log = logs["coordinator"].read_text(errors="replace")
        assert f"round 2: committed: 3 of 3 group members agree on {hashes['nat'][:12]}" in coordinator_log
        assert len(set(hashes.values())) == 1, hashes
        for host in ("nat", "nat1"):  # each reached the other only through the coordinator
            assert "through the coordinator's relay" in logs[host].read_text(errors="replace"), host
        finals = [tmp_path / host / "swarm-peer" / "final" / "model.safetensors" for host in PEERS]
        assert len({tensors_digest(f) for f in finals}) == 1, "the peers ended on different models"
    finally:
        for proc in procs:
            kill_family(proc)
