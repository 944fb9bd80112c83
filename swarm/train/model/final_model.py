"""The final model a peer writes when a run finishes: `<state-dir>/final/model.safetensors`.

Tensor names are the module's own ``state_dict`` names (a Hugging Face model's are its own), parameters
holding θg, so ``model.load_state_dict`` takes the file as it is; tied weights appear under each of their names.
The metadata holds the round, the state hash, the run spec, the run id (a peer's) and, for a Hugging Face model,
its config (what ``swarm export`` needs). Helpers here read it back: a digest to compare peers, and its held-out eval loss.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from swarm.config import RunConfig
from swarm.core.safetensors_io import write_safetensors
from swarm.core.state import GlobalState

HF_CONFIG_KEY = "hf_config"
RUN_SPEC_KEY = "run_spec"
RUN_ID_KEY = "run_id"  # the coordinator's id of the run (a peer's final model): another run's file is set aside


def final_tensors(model: nn.Module, state: GlobalState) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with θg in place of the parameters: the tensors themselves (CPU), no copies."""
    global_by_param = {id(p): g for p, g in zip(model.parameters(), state.params)}
    return {
        name: global_by_param.get(id(value), value.detach()).detach().to("cpu")
        for name, value in model.state_dict(keep_vars=True).items()
    }


def write_final_model(
    path: Path, model: nn.Module, state: GlobalState, *, run: RunConfig | None = None, run_id: str | None = None
) -> None:
    """θg under the model's state_dict names (``model.load_state_dict`` takes it), written atomically, straight
    from the tensors' memory (``swarm.core.safetensors_io.write_safetensors``: no copy of the model is made). The header
    lists the tensors and the metadata in a fixed order, so peers holding the same θg write the same bytes."""
    metadata = {"round_no": str(state.round_no), "state_hash": state.state_hash}
    if run is not None:
        metadata[RUN_SPEC_KEY] = run.to_json()
    if run_id is not None:
        metadata[RUN_ID_KEY] = run_id
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        metadata[HF_CONFIG_KEY] = config.to_json_string(use_diff=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb", buffering=0) as f:
        write_safetensors(f, final_tensors(model, state), metadata=dict(sorted(metadata.items())), digest=False)
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    from swarm.train.model.run_model import build_run_model, load_weights

    model = build_run_model(run.model, seed=run.seed).module
    load_weights(model, path)
    return model


def final_eval_loss(path: Path, run: RunConfig) -> float:
    """Held-out loss of a final model, computed exactly as the peers evaluate."""
    from swarm.train.data.data import eval_loss, load_corpus
    from swarm.train.model.run_model import build_run_model, load_weights

    built = build_run_model(run.model, seed=run.seed)
    load_weights(built.module, path)
    return eval_loss(
        built.module,
        load_corpus(run.data),
        batch_size=run.data.batch_size,
        seq_len=run.data.seq_len,
        num_batches=run.data.eval_batches,
        loss=built.loss,
    )
