"""The inner AdamW, and its step without importing TorchDynamo: about 1.3 CPU-seconds of every peer's start.

``torch.optim`` reaches for ``torch._dynamo`` even when nothing is compiled: ``Optimizer.step`` imports it
to insert a graph break (a no-op outside ``torch.compile``), and ``add_param_group`` (which ``__init__``
calls), ``zero_grad``, ``state_dict`` and ``load_state_dict`` import it the first time they run, to mark
themselves as methods a compiled region must not trace into. A restarting peer paid that import before its
first step. Swarm compiles only the model's forward (``swarm.train.inner_step``), which never calls the
optimizer, so neither mark does anything here:

- ``skip_dynamo_import`` records each marked method as its own disabled form (what the wrapper caches
  after the import), as long as ``torch._dynamo`` is not loaded; once it is, the wrappers work as usual.
- ``eager_step(optimizer)`` returns the optimizer's own step body, called under ``torch.no_grad`` as
  ``step`` itself calls it, without the graph break: the same arithmetic, bit for bit. It falls back to
  ``optimizer.step`` where the wrapper does more than that (step hooks, a differentiable optimizer), checked
  at every step: a hook registered after the trainer was built (torchft's DiLoCo registers its sync as a
  post hook) must run. Checked only once, when the trainer was built, torchft's DiLoCo around a ``LocalTrainer``
  would silently never sync.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, Sequence

import torch
from torch.optim import optimizer as torch_optimizer

from swarm.config import InnerOptConfig

_MARKED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def inner_adamw(params: Sequence[torch.Tensor], cfg: InnerOptConfig) -> torch.optim.AdamW:
    """The inner optimizer over ``params``, grouped as nanoGPT does: matrices and embeddings decay, LayerNorm
    gains and biases do not."""
    skip_dynamo_import()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
    )


def skip_dynamo_import() -> None:
    """Let the optimizer's dynamo-disabled methods run without importing ``torch._dynamo``."""
    if "torch._dynamo" in sys.modules:
        return
    for name in _MARKED:
        fn = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
            setattr(fn, "__dynamo_disable", fn)  # the wrapper's cache: call fn itself


def eager_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A function doing ``optimizer.step()`` (no closure) without importing ``torch._dynamo``."""
    body = inspect.unwrap(type(optimizer).step)
    if body is type(optimizer).step or optimizer.defaults.get("differentiable"):
        return optimizer.step

    def hooked() -> bool:
        hooks = (
            optimizer._optimizer_step_pre_hooks,
            optimizer._optimizer_step_post_hooks,
            getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
            getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
        )
        return any(h is None or h for h in hooks)

    def step() -> None:
        if hooked():  # one registered since (by torchft's DiLoCo, a scheduler, the user): the wrapper runs them
            optimizer.step()
            return
        with torch.no_grad():
            body(optimizer)

    return step
