"""A real two-level run: a coordinator and four peer processes in two sites on loopback."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from swarm.config import RunConfig, load_run_config
from swarm.core.site_plan import butterfly_bytes_by_site
from swarm.train.model.final_model import tensors_digest
from swarm.train.model.model import build_model
from swarm.train.simulator.sim import simulate
from tests.integration.harness import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

RUN = """
[model]
preset = "tiny"

[rounds]
inner_steps = 4
max_rounds = 3
min_peers = 4
matchmaking_window_s = 20.0
exchange_timeout_s = 20.0
round_timeout_s = 60.0
hierarchical = true
group_size = 2
straggler_slack_s = 600  # equal peers train every step, however busy the machine makes a start-up probe
"""
SITES = {"a0": "a", "b0": "b", "a1": "a", "b1": "b"}


def assert_matches_simulator(final_model, run: RunConfig, *, sites: list[str], rounds: int) -> None:
    """The real swarm's final θg equals the simulator's for the same config and sites, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peers train single-threaded; GEMM bits depend on the thread count
    try:
        sim = simulate(run, peers=len(sites), rounds=rounds, sites=sites)
    finally:
        torch.set_num_threads(threads)
    names = [name for name, _ in build_model(run.model, seed=run.seed).named_parameters()]
    final = load_file(str(final_model))
    for name, expected in zip(names, sim.final_params):
        assert torch.equal(final[name], expected), f"{name} differs from the simulator"


def bytes_per_round(log: str) -> list[tuple[int, int]]:
    """(in-site, cross-site) bytes of each exchange in a peer's log."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) in-site, (\d+) cross-site", log)]


def test_two_sites_commit_identical_state_that_matches_the_simulator(tmp_path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(RUN)
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--config", str(config), "--exit-grace-s", "0")
        for name, site in SITES.items():
            swarm.start_peer(name, "--site", site)
        codes = swarm.wait_peers(timeout_s=200)
        assert codes == {name: 0 for name in SITES}, swarm.log("a0")[-3000:]
        digests = {tensors_digest(swarm.final_model(name)) for name in SITES}
        assert len(digests) == 1, "the peers ended with different global parameters"

        coordinator_log = (tmp_path / "coordinator.log").read_text()
        index = {
            name: int(i)
            for i, name in re.findall(r"joined as index (\d+), session \d+ \(name '(\w+)'", coordinator_log)
        }
        assert sorted(index) == sorted(SITES), coordinator_log[-2000:]
        sites = [SITES[name] for name in sorted(SITES, key=index.get)]
        assert_matches_simulator(swarm.final_model("a0"), load_run_config(config), sites=sites, rounds=3)

        # Only each site's representative (its lowest index) sends across sites.
        cross = {name: sum(c for _, c in bytes_per_round(swarm.log(name))) for name in SITES}
        representatives = {min((n for n in SITES if SITES[n] == s), key=index.get) for s in "ab"}
        assert {n for n, c in cross.items() if c > 0} == representatives, cross
        # ... and all of them together send at most half of what a flat group sends across sites.
        numel = sum(t.numel() for t in load_file(str(swarm.final_model("a0"))).values())
        flat = sum(c for _, c in butterfly_bytes_by_site(numel, sites, "fp32"))
        assert all(len(bytes_per_round(swarm.log(n))) == 3 for n in SITES)
        assert sum(cross.values()) <= 3 * flat / 2 * 1.05, (cross, flat)
    finally:
        swarm.close()
