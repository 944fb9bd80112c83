"""Two-level averaging's plan (sites and a group-size cap -> sub-groups and representatives) and its math,
and the simulator running a hierarchical run."""

from __future__ import annotations

import pytest
import torch

from swarm.config import ConfigError, RunConfig
from swarm.core.average import butterfly_bytes_sent, weighted_average
from swarm.core.site_plan import butterfly_bytes_by_site, plan_sites, two_level_bytes_sent, two_level_reference
from swarm.train.simulator.sim import simulate

pytestmark = pytest.mark.timeout(120)


def shape(plan) -> list[tuple[str, tuple[int, ...]]]:
    return [(s.site, s.positions) for s in plan.subgroups]


def test_sites_become_subgroups_of_at_most_g_with_the_lowest_position_representing_each() -> None:
    plan = plan_sites(["a", "b", "a", "a", "b", "a", "a"], group_size=2)
    # site a has 5 members at positions 0,2,3,5,6: ceil(5/2) = 3 sub-groups of 2,2,1, consecutive by index
    assert shape(plan) == [("a", (0, 2)), ("b", (1, 4)), ("a", (3, 5)), ("a", (6,))]
    assert plan.representatives == [0, 1, 3, 6]
    assert plan.subgroup_of(5).representative == 3
    assert shape(plan_sites(["a", "b", "a", "a", "b", "a", "a"])) == [("a", (0, 2, 3, 5, 6)), ("b", (1, 4))]


def test_a_member_without_a_site_is_a_subgroup_of_its_own() -> None:
    assert shape(plan_sites(["", "a", "", "a"], group_size=4)) == [("", (0,)), ("a", (1, 3)), ("", (2,))]


def test_the_plan_and_its_digest_are_deterministic_and_tell_partitions_apart() -> None:
    sites = ["x", "y", "x", "y", "x"]
    assert plan_sites(sites, 2) == plan_sites(list(sites), 2)
    assert plan_sites(sites, 2).digest("g") == plan_sites(sites, 2).digest("g")
    assert plan_sites(sites, 2).digest("g") != plan_sites(sites, 3).digest("g")
    assert plan_sites(sites, 2).digest("g") != plan_sites(sites, 2).digest("h")


def test_two_level_average_is_the_flat_weighted_mean_up_to_rounding() -> None:
    generator = torch.Generator().manual_seed(3)
    deltas = [torch.randn(10_001, generator=generator) for _ in range(6)]
    weights = [40.0, 8.0, 16.0, 24.0, 32.0, 12.0]
    plan = plan_sites(["a", "a", "b", "b", "a", "b"], group_size=2)
    two_level = two_level_reference(deltas, weights, plan, "fp32")
    flat = weighted_average(deltas, weights)
    assert torch.allclose(two_level, flat, rtol=1e-5, atol=1e-6)
    assert torch.equal(two_level, two_level_reference([d.clone() for d in deltas], weights, plan, "fp32"))


def test_cross_site_bytes_of_two_sites_of_two_are_half_of_flat() -> None:
    numel, sites = 1_000_000, ["a", "a", "b", "b"]
    flat = butterfly_bytes_by_site(numel, sites, "fp32")
    assert [a + b for a, b in flat] == butterfly_bytes_sent(numel, 4, "fp32")
    two_level = two_level_bytes_sent(numel, plan_sites(sites), "fp32")
    assert sum(c for _, c in two_level) <= sum(c for _, c in flat) / 2
    assert [c > 0 for _, c in two_level] == [True, False, True, False]  # only representatives cross sites


def test_config_keys_are_validated_in_one_sentence() -> None:
    with pytest.raises(ConfigError, match="set hierarchical = true"):
        RunConfig.from_dict({"rounds": {"group_size": 4}})
    with pytest.raises(ConfigError, match="group_size must be 0"):
        RunConfig.from_dict({"rounds": {"hierarchical": True, "group_size": -1}})
    assert RunConfig.from_dict({"rounds": {"hierarchical": True, "group_size": 2}}).rounds.group_size == 2


def test_simulated_hierarchical_run_is_consistent_and_keeps_cross_site_traffic_on_representatives() -> None:
    run = RunConfig.from_dict({"model": {"preset": "tiny"}, "rounds": {"inner_steps": 2, "hierarchical": True}})
    sites = ["a", "a", "b", "b"]
    sim = simulate(run, peers=4, rounds=1, sites=sites)
    assert sim.consistent
    flat = butterfly_bytes_by_site(sim.param_count, sites, "fp32")
    assert [c > 0 for c in sim.rounds[0].cross_site_bytes] == [True, False, True, False]
    assert sum(sim.rounds[0].cross_site_bytes) <= sum(c for _, c in flat) / 2
