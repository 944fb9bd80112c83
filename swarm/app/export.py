"""``swarm export STATE_DIR OUT_DIR``: a peer's final model in a form other tools load.

A Hugging Face model becomes a ``save_pretrained`` directory (``config.json`` + ``model.safetensors``) that
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads with the run's final θg; any other model becomes
``OUT_DIR/model.safetensors`` under the module's own ``state_dict`` names.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from swarm.config import ConfigError
from swarm.train.final_model import HF_CONFIG_KEY

log = logging.getLogger(__name__)


def final_model_path(state_dir: Path) -> Path:
    path = state_dir / "final" / "model.safetensors"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; give the --state-dir of a peer whose run finished.")
    return path


def export(state_dir: Path, out_dir: Path) -> Path:
    """Write the export of ``state_dir``'s final model into ``out_dir``; returns the weights file written."""
    source = final_model_path(state_dir)
    with safe_open(str(source), framework="pt") as f:
        metadata = f.metadata() or {}
    tensors = load_file(str(source))
    out_dir.mkdir(parents=True, exist_ok=True)
    if HF_CONFIG_KEY not in metadata:
        target = out_dir / "model.safetensors"
        save_file(tensors, str(target), metadata={"format": "pt"})
        return target
    from swarm.train.hf_model import model_from_config_json, save_pretrained

    model = model_from_config_json(metadata[HF_CONFIG_KEY])
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - set(dict(model.named_buffers())):
        raise ConfigError(f"{source} does not fit the model its config describes ({(unexpected or missing)[0]!r});"
                          " it was not written by swarm for this model.")
    save_pretrained(model, out_dir)
    return out_dir / "model.safetensors"
