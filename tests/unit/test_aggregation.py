"""The aggregation rules on hand-made contributions, the weight cap, refused weights and slices, the
config knobs, and the simulator under a Byzantine peer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from swarm.config import AGGREGATIONS, ConfigError, DataConfig, InnerOptConfig, ModelConfig, RoundConfig, RunConfig
from swarm.core.aggregation import RULES, Aggregation, trim_count
from swarm.core.average import butterfly_reference, weighted_average
from swarm.core.codecs.codec import CODECS
from swarm.net.exchange.allreduce import ExchangeFailed
from swarm.net.exchange.slices.reduction import decode_slice, reduce_slice
from swarm.train.contribution import Contribution
from swarm.train.simulator.sim import simulate

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

NUMEL = 10_001


def honest(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Similar pseudo-gradients: one shared direction plus a little noise each."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=g)
    return [common + 0.3 * torch.randn(NUMEL, generator=g) for _ in range(count)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_mean_with_the_default_cap_is_bit_identical_to_the_weighted_average():
    slices, weights = honest(4), [80.0, 48.0, 16.0, 80.0]
    rule = Aggregation(max_weight=80.0)
    reduced = rule.reduce(slices, rule.weights(weights, ["a", "b", "c", "d"]))
    assert torch.equal(reduced.average, weighted_average(slices, weights))
    assert reduced.rejected == {} and reduced.clipped == {}
    assert torch.equal(
        butterfly_reference(slices, weights, "int8", reduce=lambda d, w: rule.reduce(d, w).average),
        butterfly_reference(slices, weights, "int8"),
    )


def test_clipped_mean_keeps_a_sign_flipped_x100_member_among_four_close_to_the_honest_mean():
    slices, weights = honest(4), [1.0] * 4
    attacked = slices[:3] + [-100.0 * slices[3]]
    honest_mean = weighted_average(slices[:3], weights[:3])

    plain = Aggregation(reject_factor=0).reduce(attacked, weights).average
    clipped = Aggregation(rule="clipped_mean", reject_factor=0).reduce(attacked, weights)

    assert relative_error(plain, honest_mean) > 20  # what the attack does to a plain mean
    assert relative_error(clipped.average, honest_mean) < 0.8  # at most clip_factor/4 of the median's length
    assert list(clipped.clipped) == [3] and clipped.rejected == {}


def test_trimmed_mean_drops_an_outlier_per_coordinate():
    slices = [
        torch.tensor([1.0, 2.0, 3.0]),
        torch.tensor([1.2, 2.2, 3.2]),
        torch.tensor([0.8, 1.8, 2.8]),
        torch.tensor([1e6, -1e6, 1e6]),
    ]
    reduced = Aggregation(rule="trimmed_mean", reject_factor=0).reduce(slices, [1.0] * 4)
    # per coordinate the largest and the smallest of the four are dropped: the outlier is always one of them
    torch.testing.assert_close(reduced.average, torch.tensor([1.1, 1.9, 3.1]))


def test_trimmed_mean_weighs_the_kept_values_and_falls_back_to_the_mean_when_it_cannot_trim():
    slices, weights = honest(5), [1.0, 2.0, 3.0, 4.0, 5.0]
    rule = Aggregation(rule="trimmed_mean", trim_fraction=0.0)
    assert [trim_count(k, 0.25) for k in (1, 2, 3, 4, 7, 8, 9)] == [0, 0, 1, 1, 1, 2, 2]
    assert torch.equal(rule.reduce(slices[:2], weights[:2]).average, weighted_average(slices[:2], weights[:2]))
    values, order = torch.sort(torch.stack(slices), dim=0, stable=True)
    w = torch.tensor(weights)[order]
    expected = (values[1:4] * w[1:4]).sum(0) / w[1:4].sum(0)
    torch.testing.assert_close(rule.reduce(slices, weights).average, expected)


def test_a_self_declared_huge_weight_is_capped_at_what_a_round_allows():
    run = RunConfig(data=DataConfig(batch_size=8), rounds=RoundConfig(inner_steps=50))
    rule = Aggregation.for_run(run)
    assert rule.max_weight == 400.0
    slices = honest(3)
    weights = rule.weights([400.0, 1e30, 200.0], ["a", "b", "c"])
    assert weights == [400.0, 400.0, 200.0]
    assert torch.equal(rule.reduce(slices, weights).average, weighted_average(slices, [400.0, 400.0, 200.0]))


@pytest.mark.parametrize("weight", [0.0, -5.0, math.nan, math.inf])
def test_a_weight_that_is_not_positive_and_finite_fails_naming_the_member(weight):
    with pytest.raises(ValueError, match=r"member peer-b declared the weight .*refused"):
        Aggregation().weights([8.0, weight, 8.0], ["peer-a", "peer-b", "peer-c"])


def test_a_finite_3e38_slice_is_left_out_of_the_mean_and_the_average_stays_finite():
    slices = honest(4)
    slices[2] = torch.full((NUMEL,), 3e38)
    reduced = Aggregation().reduce(slices, [1.0] * 4)
    assert list(reduced.rejected) == [2] and "left out" in reduced.rejected[2]
    assert torch.equal(reduced.average, weighted_average([slices[i] for i in (0, 1, 3)], [1.0] * 3))
    assert torch.isfinite(reduced.average).all()


def test_with_the_check_off_a_3e38_slice_overflows_the_mean_and_the_owner_refuses_to_encode_it():
    slices = honest(4)
    slices[2] = torch.full((NUMEL,), 3e38)
    rule = Aggregation(reject_factor=0)
    codec = CODECS["fp32"]
    data = [codec.encode(s) for s in slices]
    with pytest.raises(ExchangeFailed, match="cannot encode"):
        reduce_slice(rule, codec, data, [1.0, 1.0, 2.0, 1.0], NUMEL, "k")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_slices_are_refused_at_decode(bad):
    codec = CODECS["fp32"]
    values = torch.ones(8)
    values[3] = bad
    with pytest.raises(ExchangeFailed, match="non-finite|malformed"):
        decode_slice(codec, values.numpy().tobytes(), 8, "k")


def test_two_members_are_never_left_out_there_is_no_majority():
    slices = [torch.ones(4), torch.full((4,), 1e6)]
    assert Aggregation().reduce(slices, [1.0, 1.0]).rejected == {}


def test_the_config_names_every_rule_and_refuses_bad_knobs_in_one_sentence():
    assert AGGREGATIONS == RULES
    for name in AGGREGATIONS:
        RoundConfig(aggregation=name).validate()
    for bad, words in [
        (dict(aggregation="median"), "aggregation 'median' is unknown"),
        (dict(clip_factor=0.5), "clip_factor"),
        (dict(trim_fraction=0.5), "trim_fraction"),
        (dict(reject_factor=0.5), "reject_factor"),
        (dict(reject_factor=math.inf), "reject_factor"),
    ]:
        with pytest.raises(ConfigError, match=words):
            RoundConfig(**bad).validate()
    run = RunConfig.from_dict({"rounds": {"aggregation": "trimmed_mean", "trim_fraction": 0.2}})
    assert Aggregation.for_run(run).rule == "trimmed_mean"


SIM_RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="tiny"),
    data=DataConfig(max_bytes=200_000, num_shards=4, batch_size=4, seq_len=32, eval_batches=1),
    inner=InnerOptConfig(warmup_steps=1),
    rounds=RoundConfig(inner_steps=3, aggregation="clipped_mean"),
)


def sign_flip_x100(index: int, round_no: int, contribution: Contribution) -> Contribution:
    if index != 3:
        return contribution
    return dataclasses.replace(contribution, delta=-100.0 * contribution.delta, samples=10**30)


def test_the_simulator_with_clipped_mean_under_attack_is_deterministic_and_every_peer_agrees():
    first = simulate(SIM_RUN, peers=4, rounds=2, tamper=sign_flip_x100)
    second = simulate(SIM_RUN, peers=4, rounds=2, tamper=sign_flip_x100)
    assert first.consistent and second.consistent
    assert first.final_hash == second.final_hash
    plain = simulate(SIM_RUN, peers=4, rounds=2, tamper=sign_flip_x100, aggregation="mean")
    assert plain.final_hash != first.final_hash


def test_the_default_rule_is_clipped_mean_and_mean_stays_selectable():
    assert Aggregation.for_run(RunConfig()).rule == "clipped_mean"
    assert Aggregation.for_run(RunConfig.from_dict({"rounds": {"aggregation": "mean"}})).rule == "mean"
    # the lowrank codecs average their factors linearly: "auto" is the mean there, a robust rule is refused
    assert Aggregation.for_run(RunConfig.from_dict({"rounds": {"codec": "lowrank4-fp16"}})).rule == "mean"
    with pytest.raises(ConfigError, match='aggregation = "mean"'):
        RunConfig.from_dict({"rounds": {"codec": "lowrank4-fp16", "aggregation": "clipped_mean"}})


def test_clipped_mean_is_the_mean_bit_for_bit_for_peers_alike_and_in_a_group_of_two():
    rule = Aggregation.for_run(RunConfig())
    slices, weights = honest(4), [80.0, 48.0, 16.0, 80.0]
    reduced = rule.reduce(slices, weights)
    assert torch.equal(reduced.average, weighted_average(slices, weights)) and reduced.clipped == {}
    # a peer that ran far more steps than its one groupmate is not cut to the shorter one's length
    pair = [torch.ones(NUMEL), torch.full((NUMEL,), 5.0)]
    reduced = rule.reduce(pair, [8.0, 40.0])
    assert torch.equal(reduced.average, weighted_average(pair, [8.0, 40.0])) and reduced.clipped == {}
    # with a third member there is a median: the ×100 one is clipped
    trio = honest(3)
    trio[2] = -100.0 * trio[2]
    assert list(rule.reduce(trio, [1.0] * 3).clipped) == [2]
