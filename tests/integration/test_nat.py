"""A peer behind NAT (the testbed's `nat` host: MASQUERADE, nothing inbound) joins with the bare
`swarm peer --join STRING --device cpu` beside a public peer, and both commit every round and end on the
same model. No port forwarding, no relay: the NAT peer dials its groupmates itself, and libp2p carries
their slices back over those connections (a groupmate never needs to dial it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.app.testbed import Testbed, make_topology, missing_privileges
from swarm.train.final_model import tensors_digest
from tests.integration.harness import TWO_PEER_RUN, kill_family, read_join_string

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
PREFIX = "swnat-"  # every namespace of this test; teardown removes only these



def _nat_holds(bed: Testbed) -> bool:
    """h1 cannot reach the NAT host at all (a refused connection would mean it can, on a closed port)."""
    probe = (f"import socket\ns = socket.socket(); s.settimeout(2)\n"
             f"try: s.connect(({bed.address('nat')!r}, 9)); print('reached')\n"
             f"except ConnectionRefusedError: print('reached')\nexcept OSError: print('unreachable')")
    return bed.run("h1", [sys.executable, "-c", probe], capture_output=True, text=True,
                   timeout=20).stdout.strip() == "unreachable"


@pytest.fixture
def bed():
    why = missing_privileges(nat=True)
    if why:
        pytest.skip(why)
    with Testbed(make_topology(hosts=2, nat_host=True, prefix=PREFIX)) as made:
        yield made


def test_bare_peer_behind_nat_commits_every_round_and_ends_on_the_committed_model(bed, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(TWO_PEER_RUN)
    # one torch thread per process: three share this machine's cores (the CLI stays the bare command)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    assert _nat_holds(bed), "h1 can reach the NAT host: the testbed's NAT is not in place"
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "h1", "nat")}
    try:
        with open(logs["coordinator"], "wb") as err:
            procs.append(bed.spawn("h0", [sys.executable, "-m", "swarm.app.cli", "coordinator", "--config",
                                          str(config), "--host", "0.0.0.0", "--announce-host", bed.address("h0"),
                                          "--state-dir", str(tmp_path / "coordinator"), "--exit-grace-s", "0"],
                                   cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=err))
        join = read_join_string(procs[0], timeout_s=30)
        for host in ("h1", "nat"):  # the README's bare command, each in a directory of its own
            (tmp_path / host).mkdir()
            with open(logs[host], "wb") as out:
                procs.append(bed.spawn(host, [sys.executable, "-m", "swarm.app.cli", "peer", "--join", join,
                                              "--device", "cpu"], cwd=tmp_path / host, env=env, stdout=out,
                                       stderr=subprocess.STDOUT))
        for host, proc in zip(("h1", "nat"), procs[1:]):
            try:
                code = proc.wait(timeout=70)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"{host}'s peer exited with {code}:\n{logs[host].read_text(errors='replace')[-4000:]}"
        hashes = {}
        for host in ("h1", "nat"):
            log = logs[host].read_text(errors="replace")
            committed = dict(re.findall(r"r(\d+)\] committed, hash ([0-9a-f]+)", log))
            assert set(committed) == {"1", "2"}, f"{host} committed rounds {sorted(committed)}:\n{log[-3000:]}"
            hashes[host] = committed["2"]
        coordinator_log = logs["coordinator"].read_text(errors="replace")
        assert f"round 2: committed: 2 of 2 group members agree on {hashes['nat'][:12]}" in coordinator_log
        assert hashes["h1"] == hashes["nat"]
        finals = [tmp_path / host / "swarm-peer" / "final" / "model.safetensors" for host in ("h1", "nat")]
        assert tensors_digest(finals[0]) == tensors_digest(finals[1]), "the peers ended on different models"
    finally:
        for proc in procs:
            kill_family(proc)
