"""Streaming DiLoCo's pure pieces: fragments cover every parameter once, the schedule syncs each fragment
once per H steps, the merge math, and the round config's checks."""

import dataclasses
import functools

import numpy as np
import pytest
import torch

from swarm.config import FRAGMENT_PATTERNS as PATTERNS
from swarm.config import ConfigError, ModelConfig, RoundConfig, RunConfig
from swarm.core.fragments import (
    fragments,
    layer_units,
    merge_fragment,
    round_end_step,
    round_fragment,
    round_steps,
)
from swarm.train.model.model import GPT, gpt_config

pytestmark = pytest.mark.timeout(60)


@functools.cache
def _gpt_params(preset):
    model = GPT(gpt_config(ModelConfig(preset=preset)))  # names and shapes only: skip the portable init
    return tuple((name, p.shape) for name, p in model.named_parameters())


def test_layer_units_are_transformer_blocks_with_embeddings_and_final_norm_attached():
    params = _gpt_params("small")  # 6 blocks
    units = layer_units(params)
    assert len(units) == 6
    names = [[params[i][0] for i in unit] for unit in units]
    assert names[0][:2] == ["wte.weight", "wpe.weight"] and all(n.startswith("blocks.0.") for n in names[0][2:])
    assert names[-1][-1] == "ln_f.weight" and all(n.startswith("blocks.5.") for n in names[-1][:-1])
    assert layer_units([torch.Size([3]), torch.Size([2, 2])]) == [[0], [1]]  # shapes only: one unit each


# balanced splits tensors: test_fragments.py
@pytest.mark.parametrize("pattern", [p for p in PATTERNS if p != "balanced"])
@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4, 6])
def test_every_parameter_is_in_exactly_one_fragment(pattern, num_fragments):
    params = _gpt_params("small")
    groups = fragments(params, num_fragments, pattern)
    assert len(groups) == num_fragments and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(params)))
    assert all(g == sorted(g) for g in groups)


def test_strided_deals_blocks_round_robin_and_contiguous_cuts_runs():
    params = _gpt_params("small")
    block_of = lambda i: params[i][0].split(".")[1] if params[i][0].startswith("blocks.") else None  # noqa: E731
    strided = fragments(params, 3, "strided")
    assert [sorted({block_of(i) for i in g} - {None}) for g in strided] == [["0", "3"], ["1", "4"], ["2", "5"]]
    contiguous = fragments(params, 3, "contiguous")
    assert [sorted({block_of(i) for i in g} - {None}) for g in contiguous] == [["0", "1"], ["2", "3"], ["4", "5"]]
    sizes = [sum(params[i][1].numel() for i in g) for g in contiguous]
    assert max(sizes) / min(sizes) < 1.1  # balanced by element count


def test_contiguous_balances_by_size_and_keeps_every_fragment_non_empty():
    shapes = [torch.Size([1000]), torch.Size([1]), torch.Size([1]), torch.Size([1000])]
    assert fragments(shapes, 2, "contiguous") == [[0, 1], [2, 3]]
    assert fragments(shapes, 4, "contiguous") == [[0], [1], [2], [3]]
    assert fragments([torch.Size([10**6])] + [torch.Size([1])] * 3, 3, "contiguous") == [[0], [1], [2, 3]]


def test_too_many_fragments_or_an_unknown_pattern_are_refused():
    with pytest.raises(ValueError, match="layer units"):
        fragments(_gpt_params("tiny"), 3)
    with pytest.raises(ValueError, match="pattern"):
        fragments(_gpt_params("tiny"), 2, "random")


@pytest.mark.parametrize("h, f", [(1, 1), (10, 1), (10, 2), (10, 3), (7, 7), (100, 6), (12, 5)])
def test_each_fragment_syncs_exactly_once_in_every_window_of_h_steps(h, f):
    # round r syncs fragment round_fragment(r) after inner step round_end_step(r): 4F rounds span 4H steps
    fragment_after = {round_end_step(r, h, f): round_fragment(r, f) for r in range(1, 4 * f + 1)}
    assert len(fragment_after) == 4 * f and max(fragment_after) == 4 * h
    synced = [fragment_after.get(step) for step in range(1, 4 * h + 1)]
    for start in range(0, 3 * h + 1):
        window = [x for x in synced[start : start + h] if x is not None]
        assert sorted(window) == list(range(f)), (start, window)
    assert sum(round_steps(r, h, f) for r in range(1, f + 1)) == h
    assert {round_steps(r, h, f) for r in range(1, f + 1)} <= {h // f, h // f + 1}


def test_the_last_fragment_syncs_on_the_full_sync_boundary_and_one_fragment_is_diloco():
    assert [round_end_step(r, 10, 3) for r in range(1, 7)] == [3, 6, 10, 13, 16, 20]
    assert [round_fragment(r, 3) for r in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    assert [round_end_step(r, 10, 1) for r in range(4)] == [0, 10, 20, 30]
    with pytest.raises(ValueError):
        round_fragment(0, 3)


def test_merge_matches_a_plain_float32_reference():
    rng = np.random.default_rng(0)
    local = [rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    glob = [rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    for alpha in (0.5, 0.3, 0.9):
        got = merge_fragment([torch.from_numpy(x) for x in local], [torch.from_numpy(x) for x in glob], alpha)
        for g, l, gl in zip(got, local, glob):
            ref = l * np.float32(alpha) + gl * np.float32(1.0 - alpha)
            assert torch.equal(g, torch.from_numpy(ref))


def test_merge_with_alpha_zero_is_an_exact_copy_of_the_global_value():
    local, glob = [torch.tensor([5.0, 1.0, -3.0])], [torch.tensor([-0.0, 2.0, 7.0])]
    got = merge_fragment(local, glob, 0.0)
    assert torch.equal(got[0], glob[0]) and torch.signbit(got[0][0])  # -0.0 stays -0.0
    assert got[0] is not glob[0]
    with pytest.raises(ValueError):
        merge_fragment(local, glob, 1.0)


def test_round_config_checks_the_streaming_settings():
    assert RoundConfig().fragments == 1 and RoundConfig().overlap_steps == 0 and RoundConfig().mixing_alpha == 0.5
    base = RunConfig().rounds
    for bad, match in [
        (dict(fragments=0), "fragments"),
        (dict(inner_steps=4, fragments=5), "fragments"),
        (dict(fragment_pattern="random"), "fragment_pattern"),
        (dict(inner_steps=10, fragments=3, overlap_steps=4), "overlap_steps"),
        (dict(overlap_steps=-1), "overlap_steps"),
        (dict(mixing_alpha=1.0), "mixing_alpha"),
    ]:
        with pytest.raises(ConfigError, match=match):
            dataclasses.replace(base, **bad).validate()
    dataclasses.replace(base, inner_steps=10, fragments=3, overlap_steps=3).validate()
    run = RunConfig.from_dict(
        {
            "rounds": {
                "fragments": 2,
                "overlap_steps": 5,
                "mixing_alpha": 0.25,
                "fragment_pattern": "contiguous",
                "codec": "int4",
                "error_feedback": False,
            }
        }
    )
    assert RunConfig.from_json(run.to_json()) == run
