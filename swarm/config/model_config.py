"""[model] and [data]: the network every peer builds and the data it trains on."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from swarm.config.checks import MAX_BATCH, MAX_PEERS, ConfigError, check_range

# Built-in model shapes (swarm.train.model.model builds them).
MODEL_PRESETS: dict[str, dict] = {
    # ~0.22M in 4 blocks of width 64: scripts/bench_quality.py (Streaming DiLoCo with F = 4 needs 4 blocks).
    "bench": dict(n_layer=4, n_head=4, d_model=64, context=128),
    # ~0.44M: CPU tests; one AdamW step on 8x128 bytes takes ~60 ms on one core (2-core EPYC VM).
    "tiny": dict(n_layer=2, n_head=4, d_model=128, context=128),
    # ~10.8M: a CPU or a small GPU.
    "small": dict(n_layer=6, n_head=6, d_model=384, context=256),
    # ~38M: a GPU.
    "medium": dict(n_layer=12, n_head=8, d_model=512, context=512),
    # ~86M: GPT-2 small's shape (124M there is mostly its 50k-token embedding).
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, context=1024),
}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The run's model: a built-in preset (the default), ``factory`` (any ``torch.nn.Module``) or ``hf_config``
    (a Hugging Face causal LM built from its config); docs/TRAINING.md has the contract."""

    preset: str = "tiny"  # a key of MODEL_PRESETS
    context: Optional[int] = None  # overrides the preset's context length when set
    dropout: float = 0.0
    vocab_size: Optional[int] = None  # presets only: the embedding size (None: 256, one token per byte)
    factory: str = ""  # "package.module:function": takes this table as a dict, returns the module
    loss: str = ""  # optional "package.module:function(model, batch) -> loss" for a factory model
    hf_config: Any = ""  # a config.json path or an inline table: AutoModelForCausalLM.from_config
    init_from: str = ""  # a .safetensors file or a directory holding model.safetensors: θ0's weights
    options: dict[str, Any] = field(default_factory=dict)  # free-form arguments for the factory

    def validate(self) -> None:
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(f"[model] preset {self.preset!r} is unknown; choose one of {sorted(MODEL_PRESETS)}.")
        if self.context is not None and self.context < 8:
            raise ConfigError(f"[model] context must be at least 8 bytes, got {self.context}.")
        if self.context is not None:
            check_range("model", "context", self.context, 8, MAX_BATCH)
        if self.vocab_size is not None:
            check_range("model", "vocab_size", self.vocab_size, 2, 2**32)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"[model] dropout must be in [0, 1), got {self.dropout}.")
        if self.factory and self.hf_config:
            raise ConfigError("[model] factory and hf_config both name a model; keep one of them.")
        for name in ("factory", "loss"):
            if getattr(self, name) and not _HOOK.fullmatch(getattr(self, name)):
                raise ConfigError(
                    f"[model] {name} must look like 'package.module:function', got {getattr(self, name)!r}."
                )
        if self.loss and not self.factory:
            raise ConfigError("[model] loss applies to a factory model; set [model] factory too or remove loss.")
        if not isinstance(self.hf_config, (str, dict)):
            raise ConfigError("[model] hf_config must be a path to a config.json or an inline table.")

    @property
    def kind(self) -> str:
        """ "factory", "hf" or "preset"."""
        return "factory" if self.factory else "hf" if self.hf_config else "preset"


_HOOK = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" or a path to a text file / directory of text files
    seq_len: int = 128
    batch_size: int = 8
    eval_fraction: float = 0.05  # held-out share of the corpus, taken from its end
    eval_batches: int = 8
    num_shards: int = 16  # the training split is cut into this many disjoint shards
    max_bytes: Optional[int] = 8_000_000  # cap on corpus size read (None: all)
    # Token files instead of text: flat little-endian binaries of token ids (nanoGPT's train.bin), memory-mapped.
    tokens: str = ""  # a file or a glob (sorted); replaces source
    token_dtype: str = "uint16"  # "uint16" or "uint32"
    eval_tokens: str = ""  # a held-out token file; without it the last eval_fraction of tokens is held out
    # Text with a Hugging Face tokenizer: source is tokenized once and cached as a token file.
    tokenizer: str = ""  # a tokenizer.json; empty: text is bytes
    cache_dir: str = ""  # where tokenized text is cached (empty: ~/.cache/swarm/tokens)
    # What every peer's data must hash to (swarm.train.data.data_fingerprint); the coordinator fills it in from its
    # own copy of the files when it has them.
    fingerprint: str = ""

    def validate(self) -> None:
        if self.source != "stdlib" and not self.tokens and not Path(self.source).exists():
            raise ConfigError(f"[data] source {self.source!r} does not exist; give 'stdlib' or a path to text files.")
        for name in ("seq_len", "batch_size", "eval_batches", "num_shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"[data] {name} must be a positive integer, got {getattr(self, name)}.")
            check_range("data", name, getattr(self, name), 1, MAX_BATCH if name != "num_shards" else MAX_PEERS)
        if not 0.0 < self.eval_fraction < 0.5:
            raise ConfigError(f"[data] eval_fraction must be in (0, 0.5), got {self.eval_fraction}.")
        if self.max_bytes is not None and self.max_bytes < 100_000:
            raise ConfigError(f"[data] max_bytes must be at least 100000, got {self.max_bytes}.")
        if self.max_bytes is not None:
            check_range("data", "max_bytes", self.max_bytes, 100_000, 10**13)
        self._validate_tokens()

    def _validate_tokens(self) -> None:
        if self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"[data] token_dtype must be one of {list(TOKEN_DTYPES)}, got {self.token_dtype!r}.")
        if self.tokens and self.tokenizer:
            raise ConfigError("[data] tokens are already token ids; remove tokenizer, or give text as source instead.")
        if self.eval_tokens and not self.tokens:
            raise ConfigError("[data] eval_tokens needs [data] tokens for training; set tokens too.")
        if len(self.fingerprint) > 128:
            raise ConfigError("[data] fingerprint is a hex digest of at most 128 characters; copy the coordinator's.")

    @property
    def kind(self) -> str:
        """ "tokens", "tokenized" (text with a tokenizer) or "bytes"."""
        return "tokens" if self.tokens else "tokenized" if self.tokenizer else "bytes"
