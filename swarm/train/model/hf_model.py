"""A Hugging Face ``transformers`` causal LM built from its config (``[model] hf_config``): no weights are
downloaded, and θ0 is drawn with the portable normal so it is bit-identical on every machine.

``transformers`` is an optional dependency (``pip install 'swarm-train[hf]'``); it is imported only here.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarm.config import ConfigError
from swarm.config.model_sources import hf_config_dict
from swarm.train.model.model import PortableNormals

log = logging.getLogger(__name__)

HF_MISSING = "this run's model needs Hugging Face transformers; install it with: pip install 'swarm-train[hf]'."


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(HF_MISSING) from None
    transformers.logging.set_verbosity_error()  # its config warnings are not the user's mistakes here
    return transformers


def hf_auto_config(spec: Any):
    """The transformers config ``spec`` describes, with the library's defaults for what it leaves out."""
    transformers = _transformers()
    config = hf_config_dict(spec)
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    if config["model_type"] not in transformers.CONFIG_MAPPING:  # its error lists every one of ~800 names
        raise ConfigError(
            f"[model] hf_config model_type {config['model_type']!r} is not one transformers"
            f' {transformers.__version__} knows; check its spelling (e.g. "llama", "gpt2").'
        )
    try:
        return transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"[model] hf_config is not a config transformers knows ({e}); check model_type.") from None


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_ids_outside_vocab(hf_config: Any) -> str | None:
    """One sentence when the config's bos/eos/pad token ids are not ids of its vocabulary (GPT-2's defaults,
    50256, in a smaller vocabulary): ``generate()`` would look them up. None when they fit or are unset."""
    vocab = getattr(hf_config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        return None
    bad = []
    for name in SPECIAL_TOKEN_IDS:
        value = getattr(hf_config, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, int) and not 0 <= v < vocab for v in values):
            bad.append(f"{name} {value}")
    if not bad:
        return None
    return (
        f"the model's {' and '.join(bad)} {'lie' if len(bad) > 1 else 'lies'} outside its vocabulary of {vocab}"
        f" ids, so generate() cannot use {'them' if len(bad) > 1 else 'it'}: set {'them' if len(bad) > 1 else 'it'}"
        f" in [model] hf_config to ids below {vocab} (your tokenizer's special tokens)."
    )


def build_hf_model(spec: Any, *, seed: int, draw: bool = True) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` in fp32 on the CPU, with every parameter that its own init draws at
    random drawn with the portable normal instead (``model.PortableNormals``, std ``initializer_range``), seeded by
    ``seed``; constant ones (norm gains, biases) stay as the library set them. So θ0 depends only on the config and
    the seed.

    The library's random init of a parameter is not run (it would be overwritten: at 350M parameters it costs as
    much as the portable draw): it marks the parameter with a pattern that is not constant instead, and a parameter
    that is not constant once the library is done is drawn — what the library set to a constant afterwards stays.
    Buffers are initialized by the library as always.

    ``draw=False``: the parameters are about to be overwritten (a peer resuming its own checkpoint), so neither
    the library's random init nor the portable one runs; their values are whatever the memory held. The module's
    structure (tied weights) and its buffers are built as always."""
    transformers = _transformers()
    hf_config = hf_auto_config(spec)
    with torch.random.fork_rng(devices=[]), _random_init_replaced(transformers, mark=draw):
        torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"[model] hf_config does not describe a causal LM transformers can build ({e})."
            ) from None
    if draw:
        std = float(getattr(hf_config, "initializer_range", 0.02))
        with torch.no_grad():  # a constant init (ones, zeros) is already the same everywhere
            drawn = [p.data for p in model.parameters() if _varies(p.detach().reshape(-1))]
        PortableNormals(seed).fill_all(drawn, std=std, threads=torch.get_num_threads())
    model.train()
    return model


def _varies(flat: torch.Tensor) -> bool:
    """Whether ``flat`` holds more than one value (a NaN counts as a value of its own)."""
    if flat.numel() <= 1:
        return False
    if bool(flat[0] != flat[1]):
        return True  # a marked or drawn parameter: no pass over it
    return not bool((flat == flat[0]).all())


# torch.nn.init's functions that draw random numbers (the constant and copying ones still run: buffers use them)
RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def _random_init_replaced(transformers, *, mark: bool):
    """While it lasts, torch's random init functions (called by module constructors) and the ones transformers'
    ``_init_weights`` calls (through ``transformers.initialization``) draw nothing into a parameter: ``mark``
    writes a pattern that is not constant into it (``build_hf_model`` draws it next), else it is left as it is (a
    build that draws nothing takes ~0.1 s at 124M instead of seconds). Other tensors (buffers) are drawn as usual."""
    try:
        table = importlib.import_module("transformers.initialization").TORCH_INIT_FUNCTIONS
    except (ImportError, AttributeError):  # a transformers whose inits call torch.nn.init's own
        table = {}
    saved_table = {name: table[name] for name in RANDOM_INITS if name in table}
    saved_torch = {name: getattr(torch.nn.init, name) for name in RANDOM_INITS if hasattr(torch.nn.init, name)}

    def replaced(original):
        def init(tensor, *args, **kwargs):
            if not isinstance(tensor, nn.Parameter):
                return original(tensor, *args, **kwargs)
            if mark:
                with torch.no_grad():
                    torch.arange(tensor.numel(), dtype=tensor.dtype, out=tensor.view(-1))
            return tensor

        return init

    try:
        table.update({name: replaced(fn) for name, fn in saved_table.items()})
        for name, fn in saved_torch.items():
            setattr(torch.nn.init, name, replaced(fn))
        yield
    finally:
        table.update(saved_table)
        for name, fn in saved_torch.items():
            setattr(torch.nn.init, name, fn)


def hf_causal_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the next token: ``y`` is already ``x`` shifted by one, so no ``labels``."""
    x, y = batch
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def hf_context(model: nn.Module) -> int | None:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def save_pretrained(model: nn.Module, out_dir: Path) -> None:
    _transformers().utils.logging.disable_progress_bar()  # `swarm export` prints what it wrote, in one line
    model.save_pretrained(str(out_dir), safe_serialization=True)


def model_from_config_json(config_json: str) -> nn.Module:
    """A fresh model of the config a final model's metadata carries (weights to be loaded over it)."""
    transformers = _transformers()
    config = json.loads(config_json)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    return transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
