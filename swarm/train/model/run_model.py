"""The run's model, whichever kind ``[model]`` names: a built-in preset (the embedded default), a user's
``factory`` (any ``torch.nn.Module``) or a Hugging Face causal LM (``hf_config``), optionally started from
existing weights (``init_from``); with the loss the trainer minimises. docs/TRAINING.md has the contract.

θ0 is the same on every peer when the build is deterministic: presets and HF models are drawn with the
portable normal (bit-identical on every CPU); a factory's own init is seeded with the run's seed (identical on
machines whose torch draws identical random numbers); ``init_from`` makes any model exact. The coordinator
hashes θ0 from the same config, so a peer whose θ0 differs is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import nn

from swarm.config import ConfigError, ModelConfig
from swarm.train.model import hf_model
from swarm.train.model.model import GPT, VOCAB_SIZE, build_model

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass(frozen=True)
class RunModel:
    module: nn.Module
    loss: LossFn  # (module, (x, y)) -> the scalar loss to minimise (nats per token for the built-ins)
    context: int | None  # the longest sequence it takes (None: unknown, not checked)
    vocab_size: int | None  # the number of token ids it embeds (None: unknown, not checked)


def gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(*batch)[1]


def logits_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A factory model without a ``loss`` hook: ``model(x)`` gives logits (B, T, V) (or has ``.logits``)."""
    x, y = batch
    out = model(x)
    logits = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def import_hook(spec: str, what: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names; one sentence when it cannot be imported."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"[model] {what} {spec!r} cannot be imported ({e}); put its package on PYTHONPATH.") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"[model] {what} {spec!r}: {module_name} has no function {attr!r}; check the name.")
    return fn


def _factory_model(cfg: ModelConfig, seed: int) -> RunModel:
    build = import_hook(cfg.factory, "factory")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build(dataclasses.asdict(cfg))
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"[model] factory {cfg.factory!r} returned {type(module).__name__}, not a torch.nn.Module;"
            " return the model."
        )
    loss = import_hook(cfg.loss, "loss") if cfg.loss else logits_loss
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return RunModel(
        module=module.float(),
        loss=loss,
        context=None,
        vocab_size=embedding.num_embeddings if embedding is not None else None,
    )


def checked_vocab_size(cfg: ModelConfig) -> int | None:
    """The number of token ids the model ``cfg`` describes embeds, known without building it (None for a factory
    model: only its build tells); ConfigError, in one sentence, when the build would fail on the config itself (an
    hf_config transformers does not know, a factory or loss that cannot be imported). Quick next to a build."""
    if cfg.kind == "hf":
        return int(hf_model.hf_auto_config(cfg.hf_config).vocab_size)
    if cfg.kind == "factory":
        import_hook(cfg.factory, "factory")
        if cfg.loss:
            import_hook(cfg.loss, "loss")
        return None
    return cfg.vocab_size or VOCAB_SIZE


def build_run_model(cfg: ModelConfig, *, seed: int, draw: bool = True) -> RunModel:
    """The model ``cfg`` describes, on the CPU in fp32, with θ0 from ``seed`` or ``cfg.init_from``. ``draw=False``:
    its parameters are left undrawn (a preset's or an HF model's) and ``init_from`` is not read, for a caller
    that overwrites every parameter next (a peer resuming its own checkpoint); a factory's own init still runs."""
    if cfg.kind == "factory":
        built = _factory_model(cfg, seed)
    elif cfg.kind == "hf":
        module = hf_model.build_hf_model(cfg.hf_config, seed=seed, draw=draw)
        built = RunModel(
            module=module,
            loss=hf_model.hf_causal_loss,
            context=hf_model.hf_context(module),
            vocab_size=int(module.config.vocab_size),
        )
    else:
        gpt: GPT = build_model(cfg, seed=seed, draw=draw)
        built = RunModel(module=gpt, loss=gpt_loss, context=gpt.cfg.context, vocab_size=gpt.cfg.vocab_size)
    if cfg.init_from and draw:
        load_weights(built.module, init_from_file(cfg.init_from))
    return built


def init_from_file(init_from: str) -> Path:
    path = Path(init_from)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise ConfigError(
            f"[model] init_from {init_from!r} holds no model.safetensors; give a .safetensors file"
            " or a directory with one."
        )
    return path


def load_weights(module: nn.Module, path: Path) -> None:
    """Copy the file's tensors into ``module`` by state_dict name: every parameter must be there, with its shape,
    and nothing the module lacks (tied weights may appear under each of their names)."""
    tensors = load_file(str(path))
    params = dict(module.named_parameters())
    known = set(module.state_dict())
    odd = (
        sorted(set(params) - set(tensors))
        or sorted(set(tensors) - known)
        or [name for name, p in params.items() if tensors[name].shape != p.shape]
    )
    if odd:
        raise ConfigError(
            f"{path} holds other parameters than the run's model (first: {odd[0]!r}); check that it"
            " comes from a run with the same [model] settings."
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])
