"""What a new user trips on, with real processes: a peer that builds another model than the run's, a peer whose data
differs, and a finished run extended by restarting its coordinator with a larger --max-rounds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import ROOT, Swarm, kill_family, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

PEERS = ("peer-0", "peer-1")

MODEL = """
from torch import nn


class Tiny(nn.Module):
    def __init__(self, extra_norm):
        super().__init__()
        self.tok = nn.Embedding(256, 16)
        self.norm = nn.LayerNorm(16) if extra_norm else nn.Identity()
        self.head = nn.Linear(16, 256, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.tok(x)))


def build(model_table):
    return Tiny(extra_norm=EXTRA_NORM)
"""


def _cold(args: list[str], *, pythonpath: Path, log: Path, cwd: Path) -> subprocess.Popen:
    """``swarm *args`` in a fresh interpreter whose PYTHONPATH starts with ``pythonpath``: the factory module a
    user's machine has."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{pythonpath}{os.pathsep}{ROOT}")
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "swarm.app.cli", *args], stdout=out, stderr=out, env=env, cwd=cwd
        )


def test_a_peer_that_builds_another_model_exits_2_with_the_coordinator_s_reason(tmp_path: Path) -> None:
    """The run's `mymod.build` and the peer's differ by a LayerNorm: the peer says why at ERROR (no -v), exit 2."""
    for name, extra in (("run", False), ("mine", True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mymod.py").write_text(MODEL.replace("EXTRA_NORM", str(extra)))
    (tmp_path / "run.toml").write_text(
        '[model]\nfactory = "mymod:build"\n\n[rounds]\ninner_steps = 5\nmax_rounds = 2\nmin_peers = 2\n'
    )
    state = tmp_path / "coordinator"
    coordinator = _cold(
        ["coordinator", "--config", str(tmp_path / "run.toml"), "--state-dir", str(state)],
        pythonpath=tmp_path / "run",
        log=tmp_path / "coordinator.log",
        cwd=tmp_path,
    )
    peer = None
    try:
        join = poll(
            lambda: (state / "join-string").exists() and (state / "join-string").read_text().strip(),
            timeout_s=60,
            what="the join string",
        )
        peer = _cold(
            ["peer", "--join", join, "--state-dir", str(tmp_path / "peer"), "--threads", "1"],
            pythonpath=tmp_path / "mine",
            log=tmp_path / "peer.log",
            cwd=tmp_path,
        )
        code = peer.wait(timeout=90)
        log = (tmp_path / "peer.log").read_text()
        assert code == 2, log[-3000:]
        assert "Traceback" not in log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert len(errors) == 1, log[-3000:]
        # the heartbeat's refusal, or the eviction's when the main thread's call hears of it first
        assert "the coordinator rejected this peer: " in errors[0]
        # (the refusal says "model (fingerprint …)", the eviction "model fingerprint …": either names it)
        assert "builds a different model than the run" in errors[0] and "fingerprint" in errors[0]
        assert errors[0].endswith(
            "use the run's [model] code (the same factory module, preset or hf_config) and the "
            "coordinator's Swarm release, then start the peer again."
        )
        assert "restart the peer to join again" not in log and "could not join the DHT" not in log
    finally:
        for proc in (peer, coordinator):
            if proc is not None:
                kill_family(proc)


def test_a_peer_whose_data_differs_says_so_and_nothing_about_the_dht(tmp_path: Path) -> None:
    """Its start fails while its DHT starts beside the trainer build: only the data's sentence, exit 2."""
    data = tmp_path / "data.txt"
    data.write_text("".join(f"line {i} of the run's text\n" for i in range(12_000)))
    (tmp_path / "run.toml").write_text(
        f'[model]\npreset = "tiny"\n\n[data]\nsource = "{data}"\n\n'
        "[rounds]\ninner_steps = 5\nmax_rounds = 2\nmin_peers = 2\n"
    )
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--config", str(tmp_path / "run.toml"))
        with open(data, "a") as f:
            f.write("one more line on this machine only\n")
        swarm.start_peer("peer")
        assert swarm.wait_peers(timeout_s=60) == {"peer": 2}
        log = swarm.log("peer")
        assert "Traceback" not in log and "DHT" not in log and " ERROR " not in log, log[-3000:]
        assert log.strip().splitlines()[-1].startswith("swarm peer: this peer's data (fingerprint ")
    finally:
        swarm.close()


def test_a_finished_run_restarted_with_a_larger_max_rounds_commits_the_new_rounds(tmp_path: Path) -> None:
    swarm = Swarm(workdir=tmp_path)
    try:
        run = ("--min-peers", "2", "--inner-steps", "5", "--exit-grace-s", "0")
        join = swarm.start_coordinator("--max-rounds", "2", *run)
        for name in PEERS:
            swarm.start_peer(name)
        assert swarm.wait_peers(timeout_s=90) == {name: 0 for name in PEERS}
        first = {name: tensors_digest(swarm.final_model(name)) for name in PEERS}
        assert len(set(first.values())) == 1
        assert swarm.coordinator.wait(timeout=60) == 0
        swarm.peers.clear()
        swarm.close()

        assert swarm.start_coordinator("--max-rounds", "4", *run) == join
        for name in PEERS:
            swarm.start_peer(name)
        codes = swarm.wait_peers(timeout_s=90)
        assert codes == {name: 0 for name in PEERS}, swarm.log("peer-0")[-3000:]
        final = {name: tensors_digest(swarm.final_model(name)) for name in PEERS}
        assert len(set(final.values())) == 1 and set(final.values()) != set(first.values())
        log = swarm.log("coordinator")
        assert "max_rounds 2 -> 4; rounds continue after the 2 committed" in log
        assert "round 3: committed" in log and "round 4: committed" in log, log[-3000:]
        assert "finished after round 4" in log
        for name in PEERS:  # each took the run up from its own checkpoint of round 2 (or downloaded it)
            assert "resumed from own checkpoint" in swarm.log(name) or "synced to round 2" in swarm.log(name)
    finally:
        swarm.close()
