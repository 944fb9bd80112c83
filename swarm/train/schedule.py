"""The inner learning rate: a linear warmup over a peer's own first steps (its AdamW state starts empty),
then constant, or a cosine or linear decay over the run's inner steps.

Both positions are step counts a checkpoint restores, so a resumed peer gets the same rates.
"""

from __future__ import annotations

import math

from swarm.config import InnerOptConfig


def lr_at(cfg: InnerOptConfig, *, peer_step: int, run_step: int = 0, run_steps: int = 0) -> float:
    """The rate of a peer's ``peer_step``-th inner step (0-based), taken at step ``run_step`` of a run of
    ``run_steps`` inner steps (a full-speed peer's count: what the decay follows)."""
    warmup = cfg.warmup_steps
    # written as before the schedules existed, so a constant schedule gives the same floats
    base = cfg.lr * (peer_step + 1) / warmup if 0 < warmup and peer_step < warmup else cfg.lr
    if cfg.schedule == "constant" or run_steps <= 0:
        return base
    return base * decay_factor(cfg.schedule, min(max(run_step, 0) / run_steps, 1.0), cfg.min_lr_ratio)


def decay_factor(schedule: str, progress: float, min_ratio: float) -> float:
    """Fraction of the peak rate at ``progress`` in [0, 1] of the run: 1 at the start, ``min_ratio`` at
    the end."""
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "constant":
        return 1.0
    else:
        raise ValueError(f"schedule {schedule!r} is unknown; choose constant, cosine or linear.")
    return min_ratio + (1.0 - min_ratio) * shape
