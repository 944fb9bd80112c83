"""One inner AdamW step as the run's ``[inner]`` table asks for it: the batch cut into micro-batches whose
gradients accumulate, the forward and backward passes under autocast (bf16 or fp16, with a gradient scaler
for fp16), optionally through ``torch.compile``, and across the ranks of a multi-GPU peer through DDP.

The parameters and the optimizer state stay fp32 whatever the precision: only the compute is lowered.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from typing import Callable, Optional

import torch
import torch.nn as nn

from swarm.config import InnerOptConfig
from swarm.train.eager_optimizer import eager_step

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class InnerStep:
    """``step(x, y, lr)``: one optimizer step on the batch (x, y); returns its mean loss (a detached tensor
    on the device, so no step waits for the device)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        optimizer: torch.optim.Optimizer,
        cfg: InnerOptConfig,
        *,
        device: torch.device,
        wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn  # loss_fn(module, batch): the run model's loss (swarm.train.model.run_model)
        self.optimizer = optimizer
        self.cfg = cfg
        self.device = device
        self.params = list(model.parameters())  # in the model's order: the clipping norm sums in it
        self.ddp = wrap(model) if wrap is not None else None  # DDP over the peer's ranks
        self.forward: nn.Module = self.ddp if self.ddp is not None else model
        self.eager = self.forward
        self.compiled = cfg.compile and _compile_possible(device)
        if self.compiled:
            self.forward = torch.compile(self.forward)
        dtype = AUTOCAST_DTYPES.get(cfg.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
        self.optimizer_step = eager_step(optimizer)  # optimizer.step() without importing torch._dynamo

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        loss = self._gradients(x, y)
        self.update(lr)
        return loss

    def update(self, lr: float) -> None:
        """The step's update from the gradients the parameters hold (clipped, unscaled as the step's own)."""
        if self.scaler is not None and self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer_step()

    def passes(self, x: torch.Tensor, y: torch.Tensor, *, keep: bool = False) -> torch.Tensor:
        """A step's forward and backward passes, without the update (``swarm.train.step_probe``); their mean loss.
        The gradients are dropped after, or with ``keep`` left in the parameters' ``.grad``. Not on a multi-GPU
        peer: DDP would wait for the other ranks."""
        assert self.ddp is None, "a probe runs on one process"
        loss = self._gradients(x, y)
        if not keep:
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's gradients, fresh (the micro-batches' accumulated); its mean loss, detached."""
        self.optimizer.zero_grad(set_to_none=True)
        n = self.cfg.micro_batches
        if n == 1:
            loss = self._loss(x, y)
            self._backward(loss)
            return loss.detach()
        loss = torch.zeros((), device=self.device)
        for i, (xs, ys) in enumerate(zip(x.chunk(n), y.chunk(n))):
            # DDP all-reduces the gradients once, on the last micro-batch
            last = i == n - 1
            with contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync():
                part = self._loss(xs, ys) * (xs.shape[0] / x.shape[0])
                self._backward(part)
            loss += part.detach()
        return loss

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            if not self.compiled:
                return self.loss_fn(self.forward, (x, y))
            try:
                return self.loss_fn(self.forward, (x, y))
            except Exception as e:  # noqa: BLE001 - any compiler failure: train eagerly instead
                log.warning("torch.compile failed (%s); training without it.", str(e).splitlines()[0][:200])
                self.compiled, self.forward = False, self.eager
                return self.loss_fn(self.forward, (x, y))

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()


def _compile_possible(device: torch.device) -> bool:
    """torch.compile's CPU backend builds C++: without a compiler it would fail at the first step."""
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++", "cc")):
        log.warning(
            "[inner] compile = true, but this machine has no C++ compiler for torch.compile on the CPU;"
            " training without it (install g++ to compile)."
        )
        return False
    return True
