"""A step's passes made ahead, and the checks on a state a trainer installs (``fitting``, ``check_same_shapes``).

``FirstPasses``: the start-up probe (``swarm.train.step_probe``) makes the forward and backward passes of the
peer's first step on the batch and from the random state that step would use; the trainer's first step takes them
instead of making them again, while θl, the batch and the random state are still what they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState


@dataclass
class FirstPasses:
    """A step's forward and backward passes made ahead (by the start-up probe, ``swarm.train.step_probe``), for the
    trainer's next step to use instead of making them again: the same gradients, from the same θl, batch and random
    draws (dropout), so the same bits. Good only while all of those are still what they were."""

    grads: list[Optional[torch.Tensor]]
    loss: torch.Tensor
    seconds: float  # what the passes took
    versions: tuple[int, ...]  # θl's tensors' version counters: any in-place write changes them
    batches_drawn: int  # the sampler's position: the batch they were made on is the next one
    rng_before: list[torch.Tensor]  # the random state they started from (CPU, and the CUDA device's)
    rng_after: list[torch.Tensor]  # and the one they left

    def usable(self, versions: tuple[int, ...], batches_drawn: int, device: torch.device) -> bool:
        """Whether a step now would make these very passes: θl's ``versions``, the sampler's position and the
        random state on ``device`` are the ones they were made with."""
        if self.versions != versions or self.batches_drawn != batches_drawn:
            return False
        return all(torch.equal(now, then) for now, then in zip(rng_states(device), self.rng_before))


def rng_states(device: torch.device) -> list[torch.Tensor]:
    """The global random state a step on ``device`` draws from (dropout)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_rng_states(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def fitting(state: GlobalState, shapes: list[torch.Size], outer: OuterOptimizer) -> GlobalState:
    """``state`` when it is one of a model of ``shapes`` with ``outer``'s state; ValueError saying what differs."""
    if [t.shape for t in state.params] != list(shapes):
        raise ValueError(
            f"the state holds {len(state.params)} parameters whose shapes are not this model's "
            f"{len(shapes)}; it is of another model."
        )
    if [t.shape for t in state.outer_state] != outer.state_shapes():
        raise ValueError(f"the state's outer optimizer state is not this run's {outer.name} state.")
    return state


def check_same_shapes(new: list[torch.Tensor], old: list[torch.Tensor]) -> None:
    """ValueError unless a committed state's tensors ``new`` have the shapes of the ones they replace."""
    if len(new) != len(old):
        raise ValueError("committed state has the wrong number of tensors.")
    for n, o in zip(new, old):
        if n.shape != o.shape:
            raise ValueError(f"committed tensor shape {tuple(n.shape)} does not match {tuple(o.shape)}.")
