"""A run's round 0: θ0 built from the config with a zero outer state, and what identifies it (the model
fingerprint and θ0's hash). A peer's trainer starts from ``initial_state``; the coordinator computes
``run_identity`` from the same config with the same functions, so no peer decides what the run's model is."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from swarm.config import RunConfig
from swarm.core import average
from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState
from swarm.train.model.model import model_fingerprint
from swarm.train.model.run_model import build_run_model


def initial_state(model: nn.Module, outer: OuterOptimizer) -> GlobalState:
    """Round 0: the model's parameters (CPU, fp32) and the outer optimizer's fresh state."""
    return GlobalState(0, [average.as_cpu_f32(p).clone() for p in model.parameters()], outer.state_tensors())


@dataclass(frozen=True)
class RunIdentity:
    model_fingerprint: str
    initial_hash: str
    param_count: int
    vocab_size: int | None = None  # the token ids the model embeds (None: unknown)


def run_identity(run: RunConfig) -> RunIdentity:
    """The fingerprint, θ0 hash and size of the model every peer of ``run`` builds."""
    built = build_run_model(run.model, seed=run.seed)
    model = built.module
    outer = OuterOptimizer(run.outer, [p.shape for p in model.parameters()])
    return RunIdentity(
        model_fingerprint=model_fingerprint(model),
        initial_hash=initial_state(model, outer).state_hash,
        param_count=sum(p.numel() for p in model.parameters()),
        vocab_size=built.vocab_size,
    )
