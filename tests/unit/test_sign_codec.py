"""The 1-bit ``sign`` codec (sign × per-block mean |x|) and the butterfly owner's error feedback that
makes re-encoding the average at 1 bit affordable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from swarm.config import ConfigError, RunConfig
from swarm.core.average import butterfly_bytes_sent, butterfly_reference, part_bounds, weighted_average
from swarm.core.codecs.codec import get_codec
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.train.simulator.sim import simulate
from tests.unit.test_trainer_sim import RUN

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SIGN = get_codec("sign")


def test_bytes_are_fp32_scales_then_sign_bits_lsb_first():
    x = torch.tensor([1.0, -2.0, 3.0, -6.0, 0.0, -0.0, 5.0, 1.0, -9.0])  # one short block: mean |x| = 3
    data = SIGN.encode(x)
    assert data == np.float32(3.0).tobytes() + bytes([0b00001010, 0b1])  # -0.0 is not negative
    assert SIGN.decode(data, 9).tolist() == [3.0, -3.0, 3.0, -3.0, 3.0, 3.0, 3.0, 3.0, -3.0]


def test_each_block_decodes_to_its_mean_magnitude_the_best_sign_code():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 5 + 17, generator=g) * torch.linspace(0.01, 10, 64 * 5 + 17)
    y = SIGN.decode(SIGN.encode(x), x.numel())
    assert torch.equal(torch.sign(y), torch.sign(x))
    for s, e in part_bounds(x.numel(), 6, 64):
        scale = y[s:e].abs()
        assert torch.equal(scale, scale[:1].expand_as(scale))
        assert torch.allclose(scale[0], x[s:e].abs().mean(), rtol=1e-6)
        for other in (0.9 * scale[0], 1.1 * scale[0]):  # any other scale has a larger L2 error
            assert ((x[s:e] - torch.sign(x[s:e]) * other) ** 2).sum() > ((x[s:e] - y[s:e]) ** 2).sum()


def test_corrupt_payloads_are_refused_with_a_reason():
    data = bytearray(SIGN.encode(torch.ones(10)))
    data[-1] |= 0x80  # bit 15: padding after the 10th element
    with pytest.raises(ValueError, match="padding bits"):
        SIGN.decode(bytes(data), 10)
    for scale in (-1.0, float("nan"), float("inf")):
        data = bytearray(SIGN.encode(torch.ones(10)))
        data[:4] = np.float32(scale).tobytes()
        with pytest.raises(ValueError, match="scale is negative or not finite"):
            SIGN.decode(bytes(data), 10)
    with pytest.raises(ValueError, match="got 5 bytes for 10 elements, expected 6"):
        SIGN.decode(bytes(5), 10)


def test_huge_values_do_not_overflow_the_scale():
    x = torch.full((64,), 3.0e38)
    assert torch.allclose(SIGN.decode(SIGN.encode(x), 64), x, rtol=1e-6)


def _contributions(seed: int, count: int = 3, numel: int = 64 * 9 + 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(count)]


def test_owner_feedback_carries_the_second_encodings_loss_into_the_next_round():
    owners = [OwnerFeedback() for _ in range(3)]
    applied, exact = torch.zeros(64 * 9 + 5), torch.zeros(64 * 9 + 5)
    for round_no in range(4):
        contributions = _contributions(round_no)
        weights = [1.0, 2.0, 3.0]
        # first encodings are what every member decodes anyway; the owners re-encode their mean
        decoded = [SIGN.decode(SIGN.encode(c), c.numel()) for c in contributions]
        exact += weighted_average(decoded, weights)
        applied += butterfly_reference(contributions, weights, SIGN, owners=owners)
        for o in owners:
            o.commit()
        # what is not yet applied is exactly what the owners hold, slice by slice
        held = torch.cat([o.residual for o in owners])
        assert torch.allclose(applied + held, exact, atol=1e-5)
    assert [o.bounds for o in owners] == [[b] for b in part_bounds(64 * 9 + 5, 3, 64)]


def test_owner_feedback_drops_a_residual_whose_bounds_changed_and_keeps_it_when_voided():
    owner = OwnerFeedback()
    mean = torch.ones(64)
    owner.stage((0, 64), mean, torch.zeros(64))
    owner.commit()
    assert torch.equal(owner.compensate((0, 64), mean), 2 * mean)
    assert owner.compensate((64, 128), mean) is mean  # another slice: the old residual does not apply
    owner.stage((64, 128), mean, mean)
    owner.discard()  # the round was voided: nobody applied it
    assert owner.bounds == [(0, 64)]
    owner.commit()  # a committed round in which this peer owned nothing drops it
    assert owner.residual is None


def test_other_codecs_ignore_owner_feedback():
    contributions = _contributions(7)
    owners = [OwnerFeedback() for _ in range(3)]
    plain = butterfly_reference(contributions, [1.0] * 3, "int4")
    assert torch.equal(butterfly_reference(contributions, [1.0] * 3, "int4", owners=owners), plain)
    assert all(o._pending is None for o in owners)


def test_a_sign_run_in_the_simulator_is_consistent_and_uses_the_owners_residual():
    rounds = dataclasses.replace(RUN.rounds, inner_steps=2, codec="sign")
    run = RUN.replace(rounds=rounds).validate()
    sim = simulate(run, peers=2, rounds=2)
    assert sim.consistent and sim.error_feedback
    assert sim.rounds[0].bytes_sent == butterfly_bytes_sent(sim.param_count, 2, SIGN)
    # the owners' residual changes the bits from the second round on
    import swarm.core.codecs.sign_codec as sign_codec

    try:
        sign_codec.SignCodec.owner_feedback = False
        without = simulate(run, peers=2, rounds=2)
    finally:
        sign_codec.SignCodec.owner_feedback = True
    assert without.rounds[0].state_hash == sim.rounds[0].state_hash
    assert without.final_hash != sim.final_hash
    assert RunConfig.from_json('{"rounds": {"codec": "sign"}}').rounds.codec == "sign"
    with pytest.raises(ConfigError, match="only the flat butterfly keeps; set hierarchical = false"):
        RunConfig.from_json('{"rounds": {"codec": "sign", "hierarchical": true}}')
