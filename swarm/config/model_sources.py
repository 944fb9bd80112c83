"""The files and modules ``[model]`` names, looked at without importing torch or transformers: a misspelt
``hf_config`` path or ``factory`` module is reported at once, before anything slow starts (the coordinator's
imports, reading the data, building the model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from swarm.config.checks import ConfigError
from swarm.config.model_config import ModelConfig


def hf_config_dict(spec: Any) -> dict[str, Any]:
    """The config as a dict: ``spec`` is an inline table or the path of a config.json."""
    if isinstance(spec, dict):
        config = dict(spec)
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"[model] hf_config {str(spec)!r} does not exist; give a config.json path.") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"[model] hf_config {str(spec)!r} is not a readable config.json ({e}).") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError('[model] hf_config needs a model_type (e.g. "llama", "gpt2"); add it to the config.')
    return config


def check_model_sources(cfg: ModelConfig) -> None:
    """ConfigError when the hf_config is not a readable config.json with a model_type, or the module of the factory
    (or loss) cannot be found; ``swarm.train.model.run_model.checked_vocab_size`` checks the rest (a model_type
    transformers knows, the function in the module) with the slow imports."""
    if cfg.kind == "hf":
        hf_config_dict(cfg.hf_config)
    for what in ("factory", "loss"):
        spec = getattr(cfg, what)
        if spec:
            _check_module(spec.partition(":")[0], spec, what)


def _check_module(name: str, spec: str, what: str) -> None:
    try:
        found = importlib.util.find_spec(name) is not None  # imports the parent packages only, not the module
        problem = "" if found else f"No module named {name!r}"
    except (ImportError, ValueError) as e:
        problem = str(e)
    if problem:  # import_hook's sentence, which the full check would give later
        raise ConfigError(f"[model] {what} {spec!r} cannot be imported ({problem}); put its package on PYTHONPATH.")
