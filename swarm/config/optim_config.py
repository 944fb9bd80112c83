"""[inner] and [outer]: the inner AdamW steps of a peer and the outer step that applies the averaged
pseudo-gradient."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from swarm.config.checks import MAX_BATCH, MAX_LR, MAX_STEPS, ConfigError, check_range

# [inner] precision and schedule values (swarm.train.precision and swarm.train.schedule implement them).
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "cosine", "linear")
# How a multi-GPU peer's ranks hold θl (swarm.train.multi_gpu.ranks: "ddp"; swarm.train.multi_gpu.sharding: "fsdp").
SHARDINGS = ("ddp", "fsdp")

NESTEROV = "nesterov"


def outer_optimizer_names() -> list[str]:
    """Valid ``[outer] name`` values: the explicit Nesterov step, or a ``torch.optim`` class."""
    import torch

    names = [
        n
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    ]
    return [NESTEROV] + sorted(names)


def torch_optimizer_kwargs(name: str, lr: float, options: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The ``torch.optim`` class called ``name`` and its constructor arguments: ``lr``, the options
    (lists become tuples, e.g. ``betas``), and single-tensor, unfused kernels where it has the switches."""
    import torch

    cls = getattr(torch.optim, name, None)
    if (
        name == NESTEROV
        or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer))
        or cls is torch.optim.Optimizer
    ):
        raise ValueError(f"outer optimizer {name!r} is unknown; choose one of {outer_optimizer_names()}.")
    kwargs: dict[str, Any] = {"lr": lr}
    kwargs.update({k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
    accepted = inspect.signature(cls.__init__).parameters
    for switch in ("foreach", "fused"):
        if switch in accepted:
            kwargs[switch] = False
    return cls, kwargs


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
        if self.name != NESTEROV and self.name not in outer_optimizer_names():  # the default imports no torch
            raise ConfigError(f"[outer] name {self.name!r} is unknown; choose one of {outer_optimizer_names()}.")
        if self.name == NESTEROV:
            if self.options:
                raise ConfigError(
                    "[outer] options apply to torch.optim optimizers; nesterov takes lr, momentum and nesterov."
                )
            return
        import torch

        cls, kwargs = torch_optimizer_kwargs(self.name, self.lr, dict(self.options))
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[outer] options {self.options} do not fit torch.optim.{self.name} ({e}).") from None
