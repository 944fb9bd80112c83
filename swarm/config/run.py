"""Run configuration: small frozen dataclasses, one per component, loaded from TOML.

A run's spec travels from the coordinator to every peer as JSON (``RunConfig.to_json``), so every
peer builds the same model, data shards and hyper-parameters.  Unknown keys and bad values raise
``ConfigError`` with one sentence that says what to fix.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


class ConfigError(ValueError):
    """A user mistake in a run config; the message says what is wrong and what to do."""


# Valid names, listed here so that the config stays a leaf: swarm.core.codec.CODECS and
# swarm.core.fragments.PATTERNS implement exactly these (tests/unit/test_config.py checks they agree).
CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "sign", "ternary", "topk-fp16", "topk-int8", "topk-int4")
# lowrank<r>-<values> (swarm.core.lowrank): the codecs its two factors may go over the wire in
LOWRANK_VALUES = ("fp32", "fp16", "bf16", "int8", "int4")
FRAGMENT_PATTERNS = ("strided", "contiguous", "balanced")
# swarm.core.aggregation.RULES implements exactly these: how a slice's owner combines the group's slices.
AGGREGATIONS = ("mean", "clipped_mean", "trimmed_mean")
# coordinator.controller: "off" keeps [rounds] codec and equal slices; "auto" adapts them to measured links.
CONTROLLERS = ("off", "auto")

# [inner] precision and schedule values (swarm.train.precision and swarm.train.schedule implement them).
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "cosine", "linear")
# How a multi-GPU peer's ranks hold θl (swarm.train.ranks: "ddp"; swarm.train.sharding: "fsdp").
SHARDINGS = ("ddp", "fsdp")

# Built-in model shapes (swarm.train.model builds them).
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


NESTEROV = "nesterov"

# Upper bounds: far beyond any sensible run, low enough that a typo is caught before it allocates or loops.
MAX_STEPS = 10**7  # inner steps, warmup steps
MAX_BATCH = 2**16  # sequences per batch, bytes per sequence
MAX_ROUNDS = 10**9
MAX_PEERS = 10**5
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_LR = 1e3


def check_range(section: str, name: str, value: Any, low: float, high: float) -> None:
    """ConfigError unless ``value`` is a finite number in [low, high]."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"[{section}] {name} must be a finite number from {low:g} to {high:g}, got {value!r}.")


def outer_optimizer_names() -> list[str]:
    """Valid ``[outer] name`` values: the explicit Nesterov step, or a ``torch.optim`` class."""
    import torch

    names = [
        n for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    ]
    return [NESTEROV] + sorted(names)


def torch_optimizer_kwargs(name: str, lr: float, options: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The ``torch.optim`` class called ``name`` and its constructor arguments: ``lr``, the options
    (lists become tuples, e.g. ``betas``), and single-tensor, unfused kernels where it has the switches."""
    import torch

    cls = getattr(torch.optim, name, None)
    if name == NESTEROV or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ValueError(f"outer optimizer {name!r} is unknown; choose one of {outer_optimizer_names()}.")
    kwargs: dict[str, Any] = {"lr": lr}
    kwargs.update({k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
    accepted = inspect.signature(cls.__init__).parameters
    for switch in ("foreach", "fused"):
        if switch in accepted:
            kwargs[switch] = False
    return cls, kwargs


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
            raise ConfigError(
                f"[model] preset {self.preset!r} is unknown; choose one of {sorted(MODEL_PRESETS)}."
            )
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
                raise ConfigError(f"[model] {name} must look like 'package.module:function', got {getattr(self, name)!r}.")
        if self.loss and not self.factory:
            raise ConfigError("[model] loss applies to a factory model; set [model] factory too or remove loss.")
        if not isinstance(self.hf_config, (str, dict)):
            raise ConfigError("[model] hf_config must be a path to a config.json or an inline table.")

    @property
    def kind(self) -> str:
        """"factory", "hf" or "preset"."""
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
    # What every peer's data must hash to (swarm.train.data_fingerprint); the coordinator fills it in from its
    # own copy of the files when it has them.
    fingerprint: str = ""

    def validate(self) -> None:
        if self.source != "stdlib" and not self.tokens and not Path(self.source).exists():
            raise ConfigError(
                f"[data] source {self.source!r} does not exist; give 'stdlib' or a path to text files."
            )
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
        """"tokens", "tokenized" (text with a tokenizer) or "bytes"."""
        return "tokens" if self.tokens else "tokenized" if self.tokenizer else "bytes"


@dataclass(frozen=True, kw_only=True)
class InnerOptConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    grad_clip: float = 1.0
    # Compute precision of the forward and backward passes (autocast; fp16 adds a gradient scaler). The
    # parameters, the AdamW state and everything sent to other peers stay fp32.
    precision: str = "fp32"
    micro_batches: int = 1  # each step's batch is cut into this many micro-batches (gradient accumulation)
    # After the warmup: "constant", or "cosine" / "linear" decay to min_lr_ratio × lr over the run's inner
    # steps (max_rounds × inner_steps, which the decaying schedules need).
    schedule: str = "constant"
    min_lr_ratio: float = 0.1
    compile: bool = False  # torch.compile the model (falls back to eager, with a warning, where it cannot)
    prefetch: bool = True  # a background thread prepares the next batch (pinned memory on CUDA)
    # How the ranks of a multi-GPU peer (swarm peer --nproc K) split the work: "ddp" (each rank holds all of θl,
    # its gradients and AdamW state) or "fsdp" (each holds 1/K of them). A run-wide setting that a one-rank peer
    # ignores: a run's peers may have any number of GPUs.
    sharding: str = "ddp"

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"[inner] lr must be positive, got {self.lr}.")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"[inner] precision {self.precision!r} is unknown; choose one of {list(PRECISIONS)}.")
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(f"[inner] schedule {self.schedule!r} is unknown; choose one of {list(LR_SCHEDULES)}.")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"[inner] sharding {self.sharding!r} is unknown; choose one of {list(SHARDINGS)}.")
        check_range("inner", "min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_range("inner", "micro_batches", self.micro_batches, 1, MAX_BATCH)
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("[inner] weight_decay, warmup_steps and grad_clip must be non-negative.")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("[inner] beta1 and beta2 must be in [0, 1).")
        check_range("inner", "lr", self.lr, 0, MAX_LR)
        check_range("inner", "weight_decay", self.weight_decay, 0, MAX_LR)
        check_range("inner", "warmup_steps", self.warmup_steps, 0, MAX_STEPS)
        check_range("inner", "grad_clip", self.grad_clip, 0, 1e12)


@dataclass(frozen=True, kw_only=True)
class OuterOptConfig:
    # "nesterov": the explicit SGD-with-momentum step (lr, momentum, nesterov below), bit-identical on
    # every machine.  Any other value names a torch.optim class ("SGD", "Adam", "AdamW", ...), stepped
    # on the CPU in fp32 with lr and the [outer.options] table as its keyword arguments.
    name: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9  # nesterov only
    nesterov: bool = True  # nesterov only
    options: dict[str, Any] = field(default_factory=dict)  # e.g. betas = [0.9, 0.95], eps = 1e-8

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"[outer] lr must be positive, got {self.lr}.")
        check_range("outer", "lr", self.lr, 0, MAX_LR)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"[outer] momentum must be in [0, 1), got {self.momentum}.")
        for key, value in self.options.items():
            for number in value if isinstance(value, list) else [value]:
                check_range("outer.options", key, number, -1e12, 1e12)
        if self.name not in outer_optimizer_names():
            raise ConfigError(f"[outer] name {self.name!r} is unknown; choose one of {outer_optimizer_names()}.")
        if self.name == NESTEROV:
            if self.options:
                raise ConfigError("[outer] options apply to torch.optim optimizers; nesterov takes lr, momentum"
                                  " and nesterov.")
            return
        import torch

        cls, kwargs = torch_optimizer_kwargs(self.name, self.lr, dict(self.options))
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[outer] options {self.options} do not fit torch.optim.{self.name} ({e}).") from None


def check_codec_name(name: str) -> None:
    """ConfigError unless ``name`` is a codec: one of CODEC_NAMES, or a topk one with its density
    (``topk-int4@0.003``: the fraction of each chunk's values sent; the plain name sends 1%)."""
    if name in CODEC_NAMES:
        return
    if name.startswith("lowrank"):
        _check_lowrank_name(name)
        return
    base, at, density = name.partition("@")
    if not (at and base.startswith("topk-") and base in CODEC_NAMES):
        raise ConfigError(f"[rounds] codec {name!r} is unknown; choose one of {sorted(CODEC_NAMES)}"
                          " (a topk codec may name its density: topk-int4@0.003).")
    try:
        fraction = float(density)
    except ValueError:
        fraction = math.nan
    if not (math.isfinite(fraction) and 0 < fraction <= 1):
        raise ConfigError(f"[rounds] codec {name!r}: the density after '@' must be a fraction in (0, 1],"
                          f" e.g. {base}@0.01.")


def _check_lowrank_name(name: str) -> None:
    """ConfigError unless ``name`` is ``lowrank{r}-{values}``: rank r in 1..64, values a dense
    butterfly codec (``lowrank4-fp16``, ``lowrank8-int8``)."""
    rank, _, values = name[len("lowrank"):].partition("-")
    if not (rank.isdigit() and 1 <= int(rank) <= 64 and values in LOWRANK_VALUES):
        raise ConfigError(f"[rounds] codec {name!r}: a low-rank codec is lowrank<rank>-<values> with a rank from 1"
                          f" to 64 and values one of {list(LOWRANK_VALUES)}, e.g. lowrank4-fp16.")


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    inner_steps: int = 50  # H: inner steps per round
    max_rounds: Optional[int] = None  # the run finishes after this many committed rounds
    min_peers: int = 1  # round 1 opens once this many peers are ready
    codec: str = "fp32"  # wire format of pseudo-gradients
    eval_every_rounds: int = 1
    matchmaking_window_s: float = 15.0  # how long a peer waits for missing groupmates
    exchange_timeout_s: float = 60.0  # bound on moving the tensors once a group formed
    round_timeout_s: float = 900.0  # a round undecided this long after it opened is decided as is
    report_grace_s: float = 10.0  # once a hash has its group's quorum, how long the round waits for the rest
    # A round is a time budget (coordinator.budgets): a peer finishing inner_steps at most this much after the
    # fastest does them all, a slower one what fits the fastest's time; one not ready to exchange this plus
    # report_grace_s after that time is left out of the round (the others go on; it resyncs).
    straggler_slack_s: float = 5.0
    # Lossy codecs only: a peer adds what the codec dropped last time to its next pseudo-gradient.
    error_feedback: bool = True
    # SparseLoCo's decay β of the error-feedback residual: a peer sends Δ + β·residual. 1 keeps every dropped
    # value at full weight; β < 1 (e.g. 0.95) makes the residual the outer momentum (pair it with an outer
    # step without momentum).
    error_feedback_decay: float = 1.0
    # Plain DiLoCo with a lossy codec: instead of adding what the codec dropped to the next pseudo-gradient, a
    # peer restarts its inner steps from θg minus it (θl ← θg − residual), so the next Δ carries it and the
    # inner steps do not learn it a second time. Lets error feedback work with the outer momentum.
    keep_unsent_locally: bool = False
    # Streaming DiLoCo (see swarm.core.fragments): the parameters are split into `fragments` groups of layers
    # that sync one per round, staggered, each once every inner_steps steps; 1 is plain DiLoCo.
    fragments: int = 1
    # "strided" (whole blocks dealt round-robin, Streaming DiLoCo), "contiguous" (runs of whole blocks,
    # torchft) or "balanced" (equal element counts, cut across tensors on codec blocks: the lowest peak
    # bytes per sync; needs the nesterov outer optimizer)
    fragment_pattern: str = "strided"
    # A fragment's exchange runs during the next overlap_steps inner steps and is merged after them
    # (0: the peer waits for it).
    overlap_steps: int = 0
    # With overlap: local ← alpha·local + (1−alpha)·global for the merged fragment (the paper's 0.5).
    mixing_alpha: float = 0.5
    # A group smaller than the run's live peers takes a smaller outer step: the average counts the live
    # peers that did not contribute (joining, syncing, restarting) as a zero Δ. A round of one peer out
    # of five, on its own data shard, otherwise moves θg as far as a round of all five.
    scale_by_participation: bool = True
    # How the owner of a slice combines the group's slices (swarm.core.aggregation): "mean" (the
    # sample-weighted mean), "clipped_mean" (each slice clipped to clip_factor x the group's median slice
    # norm first) or "trimmed_mean" (per coordinate, the trim_fraction largest and smallest values dropped,
    # at least one of each in a group of 3 or more). Under every rule a slice whose norm exceeds
    # reject_factor x the group's median slice norm is left out of that slice's average (0: never).
    aggregation: str = "mean"
    clip_factor: float = 2.0
    trim_fraction: float = 0.25
    reject_factor: float = 100.0
    # Two-level averaging (swarm.core.site_plan): the peers of a site (the coordinator-signed site of their
    # credential) first average among themselves in sub-groups of at most group_size peers (0: no cap), and
    # one representative per sub-group takes the sub-group's average across sites; off: one flat group.
    hierarchical: bool = False
    group_size: int = 0
    # The adaptive controller (coordinator.controller). "auto": as it opens each round the coordinator picks
    # the least lossy of controller_codecs whose predicted exchange stays hidden behind computation (within
    # the overlap window, or without overlap within controller_exchange_fraction of the round), and each
    # member's share of the reduction in proportion to its measured uplink; every member applies the same
    # choice. "off": every round uses codec and equal slices, as without a controller.
    controller: str = "off"
    controller_codecs: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
    controller_exchange_fraction: float = 0.1
    controller_max_inner_steps: Optional[int] = None  # cap on the H it recommends (None: 4 x inner_steps)

    def validate(self) -> None:
        if self.inner_steps < 1:
            raise ConfigError(f"[rounds] inner_steps must be at least 1, got {self.inner_steps}.")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ConfigError(f"[rounds] max_rounds must be at least 1, got {self.max_rounds}.")
        if self.min_peers < 1:
            raise ConfigError(f"[rounds] min_peers must be at least 1, got {self.min_peers}.")
        check_codec_name(self.codec)
        if self.hierarchical and self.codec.startswith("topk-"):
            raise ConfigError(f"[rounds] codec {self.codec} is exchanged by a flat all-gather; set hierarchical = false"
                              " or choose a dense codec.")
        if self.codec.startswith("lowrank") and (self.hierarchical or self.aggregation != "mean"):
            raise ConfigError(f"[rounds] codec {self.codec} averages its factors linearly in one flat group; set"
                              " hierarchical = false and aggregation = \"mean\", or choose a dense codec.")
        if self.hierarchical and self.codec in ("sign", "ternary"):
            raise ConfigError(f"[rounds] codec {self.codec} needs its slice owners' error feedback, which only the flat butterfly"
                              " keeps; set hierarchical = false or choose int4.")
        if self.eval_every_rounds < 1:
            raise ConfigError("[rounds] eval_every_rounds must be at least 1.")
        for name in ("matchmaking_window_s", "exchange_timeout_s", "round_timeout_s", "report_grace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"[rounds] {name} must be positive, got {getattr(self, name)}.")
            check_range("rounds", name, getattr(self, name), 0, MAX_TIMEOUT_S)
        if not (math.isfinite(self.straggler_slack_s) and 0 <= self.straggler_slack_s <= MAX_TIMEOUT_S):
            raise ConfigError(f"[rounds] straggler_slack_s must be a number of seconds between 0 and {MAX_TIMEOUT_S:g},"
                              f" got {self.straggler_slack_s}.")
        if not 1 <= self.fragments <= self.inner_steps:
            raise ConfigError(f"[rounds] fragments must be between 1 and inner_steps ({self.inner_steps}),"
                              f" got {self.fragments}.")
        if self.fragment_pattern not in FRAGMENT_PATTERNS:
            raise ConfigError(f"[rounds] fragment_pattern {self.fragment_pattern!r} is unknown; choose one of {list(FRAGMENT_PATTERNS)}.")
        gap = self.inner_steps // self.fragments
        if not 0 <= self.overlap_steps <= gap:
            raise ConfigError(f"[rounds] overlap_steps must be between 0 and inner_steps // fragments ({gap}),"
                              f" got {self.overlap_steps}; an exchange must land before the next sync.")
        if not 0.0 < self.error_feedback_decay <= 1.0:
            raise ConfigError(f"[rounds] error_feedback_decay must be in (0, 1] (1: no decay), "
                              f"got {self.error_feedback_decay}.")
        if self.keep_unsent_locally and (self.fragments > 1 or self.overlap_steps > 0 or not self.error_feedback
                                         or self.error_feedback_decay != 1.0):
            raise ConfigError("[rounds] keep_unsent_locally needs plain DiLoCo with error feedback: fragments = 1,"
                              " overlap_steps = 0, error_feedback = true and error_feedback_decay = 1.")
        if not 0.0 <= self.mixing_alpha < 1.0:
            raise ConfigError(f"[rounds] mixing_alpha must be in [0, 1), got {self.mixing_alpha}.")
        check_range("rounds", "inner_steps", self.inner_steps, 1, MAX_STEPS)
        check_range("rounds", "min_peers", self.min_peers, 1, MAX_PEERS)
        check_range("rounds", "eval_every_rounds", self.eval_every_rounds, 1, MAX_ROUNDS)
        if self.max_rounds is not None:
            check_range("rounds", "max_rounds", self.max_rounds, 1, MAX_ROUNDS)
        self._validate_aggregation()
        self._validate_controller()
        self._validate_hierarchy()

    def _validate_controller(self) -> None:
        if self.controller not in CONTROLLERS:
            raise ConfigError(f"[rounds] controller {self.controller!r} is unknown; choose one of {list(CONTROLLERS)}.")
        dense = [c for c in CODEC_NAMES if not c.startswith("topk-")]
        unknown = [c for c in self.controller_codecs if c not in dense]
        if unknown or not self.controller_codecs:
            raise ConfigError(f"[rounds] controller_codecs must list codecs among {dense},"
                              f" got {list(self.controller_codecs)}.")
        if self.controller != "off" and self.codec.startswith(("topk-", "lowrank")):
            raise ConfigError(f"[rounds] codec {self.codec} is not one the controller chooses among; set"
                              " controller = \"off\" to send it every round.")
        if not (math.isfinite(self.controller_exchange_fraction) and 0 < self.controller_exchange_fraction <= 1):
            raise ConfigError(f"[rounds] controller_exchange_fraction must be in (0, 1],"
                              f" got {self.controller_exchange_fraction}.")
        cap = self.controller_max_inner_steps
        if cap is not None:
            check_range("rounds", "controller_max_inner_steps", cap, self.inner_steps, MAX_STEPS)

    def _validate_hierarchy(self) -> None:
        if self.group_size and not self.hierarchical:
            raise ConfigError("[rounds] group_size applies only to two-level averaging; set hierarchical = true"
                              " or remove group_size.")
        if not 0 <= self.group_size <= MAX_PEERS:
            raise ConfigError(f"[rounds] group_size must be 0 (no cap) or a number of peers from 1 to {MAX_PEERS},"
                              f" got {self.group_size}.")

    def _validate_aggregation(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"[rounds] aggregation {self.aggregation!r} is unknown; choose one of {list(AGGREGATIONS)}.")
        if not (math.isfinite(self.clip_factor) and self.clip_factor >= 1.0):
            raise ConfigError(f"[rounds] clip_factor must be a finite number of at least 1, got {self.clip_factor}.")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"[rounds] trim_fraction must be in [0, 0.5), got {self.trim_fraction}.")
        if not (math.isfinite(self.reject_factor) and (self.reject_factor == 0 or self.reject_factor >= 1.0)):
            raise ConfigError(f"[rounds] reject_factor must be 0 (off) or a finite number of at least 1,"
                              f" got {self.reject_factor}.")


WANDB_MODES = ("offline", "online")
_WANDB_PROJECT = re.compile(r"[\w.-]{1,128}")
MAX_PATH_CHARS = 4096


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases logging; an empty project switches it off."""

    project: str = ""
    mode: str = "offline"  # "offline": files only (``wandb sync`` uploads them later); "online": upload as it runs
    entity: str = ""  # the W&B team or user (empty: the logged-in user's default)
    dir: str = "wandb"  # where run files go: <dir>/<peer name or id>, <dir>/coordinator

    def validate(self) -> None:
        if not self.project:
            if self.entity or self.mode != "offline" or self.dir != "wandb":
                raise ConfigError("[logging] wandb needs a project, e.g. wandb = { project = \"my-run\" }.")
            return
        if not _WANDB_PROJECT.fullmatch(self.project):
            raise ConfigError(f"[logging] wandb project must be 1 to 128 letters, digits, '.', '-' or '_',"
                              f" got {self.project!r}.")
        if self.mode not in WANDB_MODES:
            raise ConfigError(f"[logging] wandb mode {self.mode!r} is unknown; choose one of {list(WANDB_MODES)}.")
        if self.entity and not _WANDB_PROJECT.fullmatch(self.entity):
            raise ConfigError(f"[logging] wandb entity must be letters, digits, '.', '-' or '_', got {self.entity!r}.")
        _check_dir("wandb dir", self.dir)


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Training logs for the tools ML engineers use; each writer is an optional extra (``pip install
    swarm-train[tensorboard]`` / ``[wandb]``). Every peer logs under ``<dir>/<its name or id>``, the
    coordinator under ``<dir>/coordinator``, each on its own machine."""

    tensorboard: str = ""  # a directory for TensorBoard event files (empty: off)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        if self.tensorboard:
            _check_dir("tensorboard", self.tensorboard)
        self.wandb.validate()


def _check_dir(name: str, path: str) -> None:
    if "\0" in path or len(path) > MAX_PATH_CHARS or not path.strip():
        raise ConfigError(f"[logging] {name} must be a directory path of at most {MAX_PATH_CHARS} characters,"
                          f" got {path[:80]!r}.")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterOptConfig = field(default_factory=OuterOptConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> "RunConfig":
        check_range("top level", "seed", self.seed, 0, 2**63 - 1)
        for section in (self.model, self.data, self.inner, self.outer, self.rounds, self.logging):
            section.validate()
        if self.inner.schedule != "constant" and self.rounds.max_rounds is None:
            raise ConfigError(f"[inner] schedule {self.inner.schedule!r} decays over the run's inner steps; set"
                              " [rounds] max_rounds, or use schedule = \"constant\".")
        if self.data.batch_size % self.inner.micro_batches:
            raise ConfigError(f"[inner] micro_batches {self.inner.micro_batches} must divide [data] batch_size"
                              f" {self.data.batch_size}.")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "config") -> "RunConfig":
        return _build(cls, data, origin=origin, section="").validate()

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text), origin="run spec")

    def replace(self, **sections: Any) -> "RunConfig":
        return dataclasses.replace(self, **sections)


MAX_CONFIG_BYTES = 1_000_000


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run TOML file; every mistake becomes one ConfigError sentence."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {str(path)!r} is larger than {MAX_CONFIG_BYTES} bytes; give a run TOML file.")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist; check the --config path.") from None
    except IsADirectoryError:
        raise ConfigError(f"config path {str(path)!r} is a directory; give the run TOML file inside it.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text; save it as UTF-8 TOML.") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror}); check its permissions.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML ({e}); fix the syntax.") from None
    return RunConfig.from_dict(data, origin=str(path))


def _build(cls: type, data: Any, *, origin: str, section: str) -> Any:
    where = f"[{section}]" if section else "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {where} must be a table, got {type(data).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{origin}: unknown key {unknown[0]!r} in {where}; valid keys are {sorted(fields)}."
        )
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, origin=origin, section=f"{section}.{name}" if section else name)
        elif (section, name) in _JSON_FIELDS:
            kwargs[name] = _json_value(value, name=name, origin=origin, where=where)
        elif value is None and type(None) in typing.get_args(hints[name]):
            kwargs[name] = None  # an Optional field switched off (JSON null; TOML has no null)
        else:
            kwargs[name] = _coerce(value, default, name=name, origin=origin, where=where)
    return cls(**kwargs)


# Free-form values (strings, numbers, booleans, lists, tables) handed to user code as they are.
_JSON_FIELDS = {("model", "hf_config"), ("model", "options")}


def _json_value(value: Any, *, name: str, origin: str, where: str) -> Any:
    if name == "hf_config" and not isinstance(value, (str, dict)):
        raise ConfigError(f"{origin}: hf_config in {where} must be a path to a config.json or an inline table.")
    if name == "options" and not isinstance(value, dict):
        raise ConfigError(f"{origin}: options in {where} must be a table, got {type(value).__name__}.")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: {name} in {where} holds a value JSON cannot carry (a date, NaN);"
                          " use strings and numbers.") from None


def _coerce(value: Any, default: Any, *, name: str, origin: str, where: str) -> Any:
    bad = ConfigError(
        f"{origin}: {name} in {where} has the wrong type {type(value).__name__}"
        f" ({value!r}); expected {type(default).__name__ if default is not None else 'an integer or nothing'}."
    )
    if default is None:  # the optional fields (context, max_rounds) are integers that default to None
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise bad
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise bad
        return value
    if isinstance(default, tuple):  # a list of names, e.g. controller_codecs
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{origin}: {name} in {where} must be a list of strings, got {value!r}.")
        return tuple(value)
    if isinstance(default, dict):  # a sub-table of keyword arguments, e.g. [outer.options]
        if not isinstance(value, dict):
            raise bad
        out = {}
        for key, item in value.items():
            number = (int, float)
            ok = isinstance(item, (bool, int, float)) or (
                isinstance(item, (list, tuple)) and all(isinstance(x, number) and not isinstance(x, bool) for x in item)
            )
            if not isinstance(key, str) or not ok:
                raise ConfigError(f"{origin}: {name}.{key} in {where} must be a number, a boolean or a list of"
                                  f" numbers, got {item!r}.")
            out[key] = list(item) if isinstance(item, (list, tuple)) else item
        return out
    raise bad
