"""The final model a peer writes when a run finishes: `<state-dir>/final/model.safetensors`.

Tensor names are those of `swarm.train.model.GPT.named_parameters()`; the metadata holds the round and the
state hash. Helpers here read it back: a digest to compare peers, and its held-out eval loss.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from swarm.config import RunConfig
from swarm.core.state import GlobalState, write_atomically


def write_final_model(path: Path, names: list[str], state: GlobalState) -> None:
    """θg under the model's parameter names (``model.load_state_dict`` takes it), written atomically."""
    tensors = {name: p.contiguous() for name, p in zip(names, state.params)}
    write_atomically(path, save(tensors, metadata={"round_no": str(state.round_no), "state_hash": state.state_hash}))


def tensors_digest(path: Path) -> str:
    """SHA-256 (16 hex chars) over the file's tensors by name: equal digests mean equal parameters."""
    tensors = load_file(str(path))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def load_into_model(path: Path, run: RunConfig) -> torch.nn.Module:
    """The run's model with the file's parameters (a final model, a warm start)."""
    from swarm.train.model import build_model

    model = build_model(run.model, seed=run.seed)
    tensors = load_file(str(path))
    names = [name for name, _ in model.named_parameters()]
    if sorted(tensors) != sorted(names):
        raise ValueError(f"{path} holds other parameters than the run's model ({run.model.preset}); "
                         "check that it comes from a run with the same [model] settings.")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model


def final_eval_loss(path: Path, run: RunConfig) -> float:
    """Held-out loss of a final model, computed exactly as the peers evaluate."""
    from swarm.train.data import ByteCorpus, eval_loss

    model = load_into_model(path, run)
    return eval_loss(model, ByteCorpus.load(run.data), batch_size=run.data.batch_size,
                     seq_len=run.data.seq_len, num_batches=run.data.eval_batches)
