"""θ0 of a Hugging Face model is drawn once: the library's random init only marks the parameters it would draw,
and the portable normal fills them, on several threads when it may. The bits are those of the library's init
redrawn with the portable normal, one tensor after another on one thread."""

from __future__ import annotations

import pytest
import torch

from swarm.train.model import model as model_module
from swarm.train.model.model import PortableNormals

pytestmark = [pytest.mark.timeout(60)]

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64}
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _library_init_redrawn(spec: dict, seed: int) -> list[torch.Tensor]:
    """θ0 the long way: ``from_config`` with the library's own random init, then every parameter it did not set
    to a constant redrawn with the portable normal, in order, on one thread."""
    from swarm.train.model.hf_model import _transformers, hf_auto_config

    config = hf_auto_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _transformers().AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    normals = PortableNormals(seed)
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        if flat.numel() > 1 and not bool((flat == flat[0]).all()):
            normals.fill(p.data, std=config.initializer_range)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("spec", [TINY_GPT2, TINY_LLAMA], ids=["gpt2", "llama"])
def test_theta0_is_the_library_init_redrawn_bit_for_bit_and_leaves_the_random_stream_alone(spec, monkeypatch):
    pytest.importorskip("transformers")
    from swarm.train.model.hf_model import build_hf_model

    expected = _library_init_redrawn(spec, seed=5)
    monkeypatch.setattr(PortableNormals, "CHUNK", 1000)  # stretches cut inside tensors, and several threads
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for threads in (1, 3):
        with monkeypatch.context() as m:
            m.setattr(torch, "get_num_threads", lambda: threads)
            built = [p.detach() for p in build_hf_model(spec, seed=5).parameters()]
        assert [t.shape for t in built] == [t.shape for t in expected]
        assert all(torch.equal(a, b) for a, b in zip(built, expected)), f"{threads} thread(s)"
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_stream_drawn_on_several_threads_is_the_one_drawn_on_one(monkeypatch):
    monkeypatch.setattr(model_module.PortableNormals, "CHUNK", 64)
    sizes = [5, 300, 1, 129, 1000, 64]
    one = [torch.empty(n) for n in sizes]
    PortableNormals(9).fill_all(one, std=0.02)
    for threads in (2, 3, 7):
        many = [torch.empty(n) for n in sizes]
        normals = PortableNormals(9)
        normals.fill_all(many, std=0.02, threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(many, one)), threads
        after = torch.empty(10)
        normals.fill(after, std=0.02)  # the stream goes on after the last element drawn
        expected = PortableNormals(9)
        expected.fill_all([torch.empty(n) for n in sizes], std=0.02)
        again = torch.empty(10)
        expected.fill(again, std=0.02)
        assert torch.equal(after, again)
