"""A real workload end to end: a small Hugging Face Llama-style model (a config.json, no download) trained by a real
coordinator and two real peers on token files made with a BPE tokenizer trained here, then exported and loaded
with ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from swarm.app.cli import main as cli_main
from swarm.train.model.final_model import tensors_digest
from swarm.train.model.hf_model import build_hf_model
from tests.integration.harness import ROOT, Swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

LLAMA = {
    "model_type": "llama",
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 64,
}

RUN = """
[model]
hf_config = "{config}"

[data]
tokens = "{tokens}"
token_dtype = "uint16"
seq_len = 64
batch_size = 8
num_shards = 2
eval_batches = 2

[inner]
lr = 0.003
warmup_steps = 2

[rounds]
inner_steps = 5
max_rounds = 3
min_peers = 2
matchmaking_window_s = 10.0
exchange_timeout_s = 10.0
round_timeout_s = 30.0
"""


def _token_file(tmp_path: Path) -> Path:
    """This repository's Python sources, through a 512-token BPE trained on them by scripts/train_tokenizer.py."""
    from tokenizers import Tokenizer

    from scripts.train_tokenizer import texts, train

    source = str(ROOT / "swarm")
    train(source, vocab_size=LLAMA["vocab_size"], out=str(tmp_path / "tokenizer.json"), max_bytes=200_000)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = np.concatenate([e.ids for e in tokenizer.encode_batch(list(texts(source, 200_000)))])
    assert 0 < ids.max() < LLAMA["vocab_size"]
    path = tmp_path / "train.bin"
    path.write_bytes(ids.astype("<u2").tobytes())
    return path


def test_two_peers_train_a_hugging_face_model_on_tokenized_data_and_its_export_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(RUN.format(config=tmp_path / "config.json", tokens=_token_file(tmp_path)))

    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--config", str(run_toml), "--exit-grace-s", "0")
        swarm.start_peer("peer-0")
        swarm.start_peer("peer-1")
        assert swarm.wait_peers(timeout_s=150) == {"peer-0": 0, "peer-1": 0}, swarm.log("peer-0")[-3000:]
    finally:
        swarm.close()
    assert "run finished at round 3" in swarm.log("peer-0")
    assert tensors_digest(swarm.final_model("peer-0")) == tensors_digest(swarm.final_model("peer-1"))

    final = load_file(str(swarm.final_model("peer-0")))  # θg of round 3 under the model's own names
    assert cli_main(["export", str(tmp_path / "peer-0"), str(tmp_path / "hf")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    params = dict(loaded.named_parameters())
    assert 200_000 < sum(p.numel() for p in params.values()) < 500_000
    assert params.keys() <= final.keys()
    assert all(torch.equal(p, final[name]) for name, p in params.items())
    theta0 = dict(build_hf_model(LLAMA, seed=0).named_parameters())  # the run's seed
    assert not any(torch.equal(theta0[name], p) for name, p in params.items() if p.dim() >= 2)  # it trained
