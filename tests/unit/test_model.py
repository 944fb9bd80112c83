"""The byte-level GPT: seeded, machine-independent initialisation, fingerprints and presets."""

import math

import pytest
import torch

from swarm.config import MODEL_PRESETS as PRESETS
from swarm.config import ModelConfig
from swarm.core.state import state_hash
from swarm.train.model.model import GPT, build_model, gpt_config, model_fingerprint

pytestmark = pytest.mark.timeout(60)

TINY = ModelConfig(preset="tiny")


def test_same_seed_gives_bit_identical_parameters_and_other_seeds_differ():
    a, b, c = build_model(TINY, seed=7), build_model(TINY, seed=7), build_model(TINY, seed=8)
    pa, pb, pc = list(a.parameters()), list(b.parameters()), list(c.parameters())
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert all(not torch.equal(x, y) for x, y in zip(pa, pc) if x.dim() >= 2)


def test_initial_parameters_match_the_golden_hash():
    # Peers on different machines and torch versions must build the same θ0; if this changes, every
    # peer of a run has to be on the new version (or θ0 has to be transferred).
    params = list(build_model(TINY, seed=0).parameters())
    assert state_hash(params, []) == "aacf0efd92611d90"


def test_build_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model(TINY, seed=1)
    assert torch.equal(torch.rand(4), expected)


def test_init_has_gpt2_scale():
    model = build_model(TINY, seed=0)
    w = model.wte.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert w.abs().max().item() < 0.02 * 3.5  # Irwin-Hall(4) is bounded at sqrt(12) std
    assert torch.equal(model.ln_f.weight, torch.ones_like(model.ln_f.weight))
    assert model.lm_head.weight is model.wte.weight


def test_fingerprint_ignores_values_and_sees_shapes():
    assert model_fingerprint(build_model(TINY, seed=0)) == model_fingerprint(build_model(TINY, seed=1))
    longer = build_model(ModelConfig(preset="tiny", context=64), seed=0)
    assert model_fingerprint(longer) != model_fingerprint(build_model(TINY, seed=0))
    assert len(model_fingerprint(longer)) == 64


def test_forward_loss_starts_near_uniform_and_is_causal():
    model = build_model(TINY, seed=0).eval()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 32, 256)
    assert abs(loss.item() - math.log(256)) < 0.7
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    logits2, none = model(changed)
    assert none is None
    assert torch.allclose(logits[:, :20], logits2[:, :20])
    assert not torch.allclose(logits[:, 20:], logits2[:, 20:])


def test_sequence_longer_than_context_is_refused():
    model = build_model(ModelConfig(preset="tiny", context=16), seed=0)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "preset, low, high",
    [("tiny", 0.3e6, 0.7e6), ("small", 8e6, 13e6), ("medium", 30e6, 50e6), ("gpt2", 80e6, 95e6)],
)
def test_preset_sizes(preset, low, high):
    with torch.device("meta"):  # no memory, no init: only the shapes
        model = GPT(gpt_config(ModelConfig(preset=preset)))
    assert low < model.param_count() < high


def test_gpt2_preset_has_gpt2_small_shape():
    assert PRESETS["gpt2"] == dict(n_layer=12, n_head=12, d_model=768, context=1024)
    with pytest.raises(ValueError, match="unknown"):
        gpt_config(ModelConfig(preset="huge"))


def test_a_model_file_round_trips_and_one_from_another_model_is_refused_with_a_message(tmp_path):
    from safetensors.torch import save_file

    from swarm.config import RunConfig
    from swarm.train.model.final_model import load_into_model

    run = RunConfig(model=TINY)
    model = build_model(TINY, seed=3)
    path = tmp_path / "model.safetensors"
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, str(path))
    loaded = load_into_model(path, run)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))

    other = tmp_path / "other.safetensors"
    bench = build_model(ModelConfig(preset="bench"), seed=0)
    save_file({name: p.detach().contiguous() for name, p in bench.named_parameters()}, str(other))
    with pytest.raises(ValueError, match="other parameters than the run's model"):
        load_into_model(other, run)
