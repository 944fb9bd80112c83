"""A model built to be overwritten (a peer resuming its own checkpoint) skips θ0's random draws but has the same
structure as the drawn one: its parameters' names and shapes, its tied weights and its buffers."""

import pytest
import torch

from swarm.config import ModelConfig
from swarm.train.model.model import model_fingerprint
from swarm.train.model.run_model import build_run_model

pytestmark = [pytest.mark.timeout(60)]

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64}


@pytest.mark.parametrize("cfg", [ModelConfig(preset="tiny"), ModelConfig(hf_config=TINY_GPT2)], ids=["preset", "hf"])
def test_an_undrawn_model_has_the_drawn_ones_structure_and_the_next_drawn_one_is_unchanged(cfg):
    if cfg.kind == "hf":
        pytest.importorskip("transformers")
    drawn = build_run_model(cfg, seed=3).module
    undrawn = build_run_model(cfg, seed=3, draw=False).module
    assert model_fingerprint(undrawn) == model_fingerprint(drawn)
    assert sum(p.numel() for p in undrawn.parameters()) == sum(p.numel() for p in drawn.parameters())  # ties kept
    buffers = dict(drawn.named_buffers())
    assert {k: torch.equal(v, buffers[k]) for k, v in undrawn.named_buffers()} == {k: True for k in buffers}
    again = build_run_model(cfg, seed=3).module  # the init functions are back: θ0 is drawn as before
    assert all(torch.equal(p, q) for p, q in zip(drawn.parameters(), again.parameters()))
