"""Seconds per inner step before a peer has trained one, so that its first round has a time budget too.

The coordinator budgets a round from the step times the peers report (``coordinator.rounds.budgets``); a peer
that has not trained yet has none, so it did its full H in its first round: a device 3× slower than the
others took 3× the round, missed its group and was out of its first two rounds (docs/BENCHMARKS.md,
"Stragglers"). At its start a peer now times a few forward and backward passes on its next batch (the
first pass warms up, the fastest of the others counts), and the optimizer's update on copies of up to
``UPDATE_SAMPLE`` of the parameters' elements (the same optimizer class and settings, scaled to all of
them: the update is elementwise), throttled like its steps. Nothing of it reaches the model, the optimizer
state, the data order or the random streams: a run trains the same bits with or without it. The measured
step time replaces it after the peer's first round.

The first probe of a peer that has not trained (``StepProbe(keep=True)``) keeps its last pass's gradients, made from
the random state the peer's first step will start from, for that step (``first_passes.FirstPasses``): a large model's
probe is then its first step's forward and backward passes rather than a pass made in addition to the round's
(at 350M parameters on a CPU, one pass is most of a step). The step uses them only when θl, its batch and the
random state are still the ones they were made with (a peer that syncs a state first makes its own); the bits are
the same either way.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from swarm.train.eager_optimizer import eager_step
from swarm.train.first_passes import FirstPasses, rng_states, set_rng_states

PROBE_PASSES = 3  # after the warm-up pass
PROBE_EVERY_S = 1.0  # while a peer waits for its first round, it probes again this often
MAX_PROBES = 10
# A pass this slow is its own estimate: the warm-up's extra cost is small beside it, and a large model's start
# (or its wait for a round, which re-probes) is not held up by passes that tell nothing new.
SLOW_PASS_S = 0.5
UPDATE_SAMPLE = 1 << 22  # elements of the parameters whose update is timed (64 MB of copies and state in fp32)


def probe_step_time(trainer, passes: int = PROBE_PASSES, *, keep: bool = False) -> Optional[float]:
    """``trainer``'s seconds per inner step as its forward and backward passes take them (None on a
    multi-GPU peer, whose ranks only step together). ``keep``: the last pass's gradients are kept for the
    trainer's next step (``LocalTrainer.keep_passes``)."""
    if trainer.ranks is not None or passes < 1:
        return None
    batches_drawn = trainer.sampler.batches_drawn
    x, y = trainer.sampler.peek_batch()
    x, y = x.to(trainer.device), y.to(trainer.device)
    cuda = trainer.device.type == "cuda"
    trainer.model.train()
    times = []
    kept: Optional[FirstPasses] = None
    with torch.random.fork_rng(devices=[trainer.device.index or 0] if cuda else []):  # dropout draws are given back
        before = rng_states(trainer.device)
        update_s = _update_seconds(trainer.optimizer, cuda=cuda)
        for i in range(passes + 1):
            set_rng_states(trainer.device, before)  # each pass draws what the next step would
            versions = trainer._versions()
            start = time.perf_counter()
            loss = trainer.inner_step.passes(x, y, keep=keep)
            if cuda:
                torch.cuda.synchronize(trainer.device)
            pass_s = time.perf_counter() - start
            compute_s = pass_s + update_s
            last = i == passes or pass_s >= SLOW_PASS_S
            if keep and last:
                kept = FirstPasses(
                    [p.grad for p in trainer._params],
                    loss,
                    pass_s,
                    versions,
                    batches_drawn,
                    before,
                    rng_states(trainer.device),
                )
            if keep:
                trainer.optimizer.zero_grad(set_to_none=True)
            if trainer.throttle is not None:  # a slow device (fault injection) is slow here too
                trainer.throttle(compute_s)
            times.append(time.perf_counter() - start + update_s)
            if last:
                break
    if kept is not None:
        trainer.keep_passes(kept)
    return min(times[1:] or times)


def _update_seconds(optimizer: torch.optim.Optimizer, *, cuda: bool) -> float:
    """Seconds of one ``optimizer`` update of all its parameters, timed on copies of the first
    ``UPDATE_SAMPLE`` elements (the tensors as they are, the last one cut) with gradients of noise."""
    groups, total, taken = [], 0, 0
    for group in optimizer.param_groups:
        copies = []
        for p in group["params"]:
            total += p.numel()
            if taken < UPDATE_SAMPLE:
                part = (
                    p.detach().flatten()[: UPDATE_SAMPLE - taken] if p.numel() > UPDATE_SAMPLE - taken else p.detach()
                )
                copy = part.clone().requires_grad_(True)
                copy.grad = torch.randn_like(copy)
                copies.append(copy)
                taken += copy.numel()
        if copies:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": copies})
    if not taken:
        return 0.0
    update = eager_step(type(optimizer)(groups))  # each group carries its settings
    times = []
    for _ in range(2):  # the first creates the optimizer's state
        start = time.perf_counter()
        update()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[-1] * total / taken


class StepProbe:
    """A peer's probes until its first round: the first at its start, again while it waits to be planned into a
    round (``again``), keeping the fastest — a start on a busy machine (other peers importing, its own DHT
    starting) measured up to 4× the step time in the demo, a probe while waiting much less."""

    def __init__(self, trainer, report: Callable[[float], None] = lambda step_s: None, *, keep: bool = False) -> None:
        """``keep``: the first probe's passes are kept for the trainer's first step (a peer that trains from the
        state it holds now: not one that syncs another first, which would hold them in memory for nothing)."""
        self.trainer, self.report = trainer, report  # told each new fastest step time
        self.keep = keep
        self.best: Optional[float] = None
        self.probes = 0
        self._next = 0.0

    def run(self) -> Optional[float]:
        """Probe now; the fastest step time yet (None: this peer cannot be probed)."""
        keep = self.keep and not self.probes and not self.trainer.inner_steps_done
        step_s = probe_step_time(self.trainer, keep=keep)
        self.probes += 1
        self._next = time.monotonic() + PROBE_EVERY_S
        if step_s is not None:
            self.best = min(step_s, self.best if self.best is not None else math.inf)
            self.report(self.best)
        return self.best

    def reuse(self, step_s: Optional[float]) -> Optional[float]:
        """A restarted peer: the step time it measured by training on this device before (its vote or checkpoint
        recorded it) stands in for a probe; without one (None), probe now."""
        if step_s is None or not math.isfinite(step_s) or step_s <= 0:
            return self.run()
        self.best = step_s
        self.report(step_s)
        return step_s

    def again(self) -> Optional[float]:
        """While waiting for the first round: the fastest step time yet when a new probe was due and ran (None: not
        due, or done: the peer trained, or probed ``MAX_PROBES`` times)."""
        if (
            self.best is None
            or self.trainer.inner_steps_done
            or self.probes >= MAX_PROBES
            or time.monotonic() < self._next
            or self.best >= SLOW_PASS_S
        ):
            return None
        return self.run()
