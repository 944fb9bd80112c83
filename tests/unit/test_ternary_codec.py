"""The ``ternary`` codec (−level / 0 / +level per element, five per byte, one level per 256 elements):
its bytes, the level that minimizes each block's L2 error, refused payloads, slices that decode like the
whole, and a simulated run whose peers agree."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from swarm.config import ConfigError, RunConfig
from swarm.core.average import butterfly_bytes_sent, part_bounds
from swarm.core.codecs.codec import get_codec
from swarm.train.simulator.sim import simulate
from tests.unit.test_trainer_sim import RUN

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

TERNARY = get_codec("ternary")


def test_bytes_are_fp32_levels_then_five_codes_per_byte():
    x = torch.tensor([4.0, -4.0, 0.5, 4.0, -0.0, -4.0, 1.0])  # mean |x| 2.5: |x| <= 1.875 sends 0
    data = TERNARY.encode(x)
    codes = [1, 2, 0, 1, 0, 2, 0]  # 1: +level, 2: -level
    packed = [sum(c * 3**i for i, c in enumerate(codes[:5])), sum(c * 3**i for i, c in enumerate(codes[5:]))]
    assert data == np.float32(4.0).tobytes() + bytes(packed)
    assert TERNARY.decode(data, 7).tolist() == [4.0, -4.0, 0.0, 4.0, 0.0, -4.0, 0.0]
    assert TERNARY.encoded_size(256 * 3 + 1) == 4 * 4 + 154  # 1.725 bits per element at whole blocks


def test_each_block_keeps_its_large_values_at_their_mean_magnitude():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256 * 4 + 33, generator=g) * torch.linspace(0.01, 10, 256 * 4 + 33)
    y = TERNARY.decode(TERNARY.encode(x), x.numel())
    for s, e in part_bounds(x.numel(), 5, 256):
        kept = y[s:e] != 0
        assert torch.equal(kept, x[s:e].abs() > 0.75 * x[s:e].abs().mean())
        assert torch.equal(torch.sign(y[s:e][kept]), torch.sign(x[s:e][kept]))
        assert torch.allclose(y[s:e][kept].abs(), x[s:e][kept].abs().mean().expand(int(kept.sum())), rtol=1e-5)
    gaussian = torch.randn(256 * 40, generator=g)
    kept_energy = (
        1 - ((gaussian - TERNARY.decode(TERNARY.encode(gaussian), gaussian.numel())) ** 2).sum() / (gaussian**2).sum()
    )
    assert kept_energy > 0.79  # a sign code keeps 2/pi = 0.64


def test_block_aligned_slices_encode_like_the_whole_vector():
    x = torch.randn(256 * 6 + 10, generator=torch.Generator().manual_seed(1))
    whole = TERNARY.decode(TERNARY.encode(x), x.numel())
    parts = [TERNARY.decode(TERNARY.encode(x[s:e].contiguous()), e - s) for s, e in part_bounds(x.numel(), 4, 256)]
    assert torch.equal(torch.cat(parts), whole)


def test_corrupt_payloads_are_refused_with_a_reason():
    data = bytearray(TERNARY.encode(torch.ones(7)))
    data[-1] = 243
    with pytest.raises(ValueError, match="above 242"):
        TERNARY.decode(bytes(data), 7)
    data[-1] = 2 * 27  # a code for the 9th element of a 7-element payload
    with pytest.raises(ValueError, match="padding"):
        TERNARY.decode(bytes(data), 7)
    data[:4] = np.float32(-1.0).tobytes()
    with pytest.raises(ValueError, match="scale is negative or not finite"):
        TERNARY.decode(bytes(data), 7)


def test_a_ternary_run_in_the_simulator_is_consistent_and_refused_in_two_levels():
    rounds = dataclasses.replace(RUN.rounds, inner_steps=2, codec="ternary")
    sim = simulate(RUN.replace(rounds=rounds).validate(), peers=2, rounds=2)
    assert sim.consistent and sim.error_feedback
    assert sim.rounds[0].bytes_sent == butterfly_bytes_sent(sim.param_count, 2, TERNARY)
    with pytest.raises(ConfigError, match="codec ternary needs its slice owners' error feedback"):
        RunConfig.from_json('{"rounds": {"codec": "ternary", "hierarchical": true}}')
