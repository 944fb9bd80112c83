"""The outer optimizer: θg ← OuterOpt(θg, Δ̄) as a pure step (``outer_step``, explicit Nesterov) and as
an object whose state is a fixed list of tensors (``OuterOptimizer``), so the state can be hashed,
sent to a joining peer and checkpointed. Same bit-exactness rules as ``swarm.core.average``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from swarm.config import NESTEROV, OuterOptConfig, torch_optimizer_kwargs
from swarm.core.average import _F32, _f32, as_cpu_f32


def outer_step(
    params: Sequence[torch.Tensor],
    avg_delta: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One SGD-with-momentum step on θg with the averaged pseudo-gradient as its gradient.

    Pure: returns new (params, momentum) and leaves the inputs untouched.  Mathematically this is
    torch.optim.SGD(lr, momentum, nesterov); torch's SGD uses ``add_(x, alpha=...)``, which may be
    fused, so its bits can differ from these in the last place.
    """
    if not (len(params) == len(avg_delta) == len(momentum)):
        raise ValueError(f"got {len(params)} params, {len(avg_delta)} deltas, {len(momentum)} momentum tensors.")
    lr_t, mu_t = _f32(lr), _f32(momentum_coef)
    new_params, new_momentum = [], []
    for p, g, m in zip(params, avg_delta, momentum):
        if not (p.shape == g.shape == m.shape):
            raise ValueError(f"shape mismatch in outer_step: {tuple(p.shape)}, {tuple(g.shape)}, {tuple(m.shape)}.")
        p, g, m = as_cpu_f32(p), as_cpu_f32(g), as_cpu_f32(m)
        m_new = (m * mu_t) + g
        update = g + (m_new * mu_t) if nesterov else m_new
        new_params.append(p - (update * lr_t))
        new_momentum.append(m_new)
    return new_params, new_momentum


class OuterOptimizer:
    """θg ← OuterOpt(θg, Δ̄), with the optimizer's state held as a fixed list of tensors so it can be
    hashed (``state_hash(params, state_tensors())``), sent to a joining peer and checkpointed.

    ``name = "nesterov"`` (the default) is ``outer_step``: explicit fp32 ops, identical on every
    machine; its state is one momentum buffer per parameter.
    Any other name is a ``torch.optim`` class, run on the CPU in fp32 with ``foreach=False`` and
    ``fused=False``.  Its bits then come from torch's own CPU kernels, which are deterministic for one
    torch build on one CPU capability (ATen picks AVX2/AVX-512 code at run time; pin it with
    ``ATEN_CPU_CAPABILITY`` when the swarm mixes CPU generations).  Its state layout is, per parameter,
    an ``initialized`` flag (0-dim fp32: 0 until the parameter's first outer step, so torch's own lazy
    initialisation runs exactly as it would) followed by the optimizer's state tensors in key order.

    Steps may cover a subset of the parameters (a streaming fragment); the other parameters and their
    state are untouched, as if each fragment had its own optimizer.
    """

    def __init__(self, config: "OuterOptConfig", shapes: Sequence[torch.Size]) -> None:
        self.config = config
        self.name = config.name
        self.shapes = [torch.Size(s) for s in shapes]
        # layout: (parameter index, key, shape, dtype) per state tensor, grouped by parameter
        self._layout: list[tuple[int, str, torch.Size, torch.dtype]] = []
        if self.name == NESTEROV:
            if config.options:
                raise ValueError(
                    "[outer] options apply to torch.optim optimizers; nesterov takes lr, momentum, nesterov."
                )
            self._layout = [(i, "momentum", s, _F32) for i, s in enumerate(self.shapes)]
        else:
            self._cls, self._kwargs = torch_optimizer_kwargs(self.name, config.lr, dict(config.options))
            keys_by_shape: dict[torch.Size, list[tuple[str, torch.Size, torch.dtype]]] = {}
            for i, shape in enumerate(self.shapes):
                if shape not in keys_by_shape:
                    keys_by_shape[shape] = self._discover_state(shape)
                self._layout.append((i, "initialized", torch.Size([]), _F32))
                self._layout.extend((i, key, s, dt) for key, s, dt in keys_by_shape[shape])
        self._slots: list[list[int]] = [[] for _ in self.shapes]  # state positions of each parameter
        for pos, (i, _, _, _) in enumerate(self._layout):
            self._slots[i].append(pos)
        self._state: list[torch.Tensor] = [torch.zeros(s, dtype=dt) for _, _, s, dt in self._layout]

    def _discover_state(self, shape: torch.Size) -> list[tuple[str, torch.Size, torch.dtype]]:
        """The keys, shapes and dtypes of the state the torch optimizer keeps for a parameter of ``shape``
        (one throwaway step on zeros)."""
        p = torch.nn.Parameter(torch.zeros(shape, dtype=_F32))
        p.grad = torch.zeros(shape, dtype=_F32)
        try:
            opt = self._cls([p], **self._kwargs)
            opt.step()
        except Exception as e:
            raise ValueError(
                f"[outer] optimizer {self.name} cannot step a {tuple(shape)} fp32 CPU parameter ({e})."
            ) from None
        found = []
        for key, value in sorted(opt.state[p].items()):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"[outer] optimizer {self.name} keeps non-tensor state {key!r}; it is not supported.")
            found.append((key, value.shape, value.dtype))
        return found

    # ---- state ------------------------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """The state, in the fixed layout (for Nesterov: one momentum tensor per parameter).  The
        tensors are the optimizer's own: do not modify them."""
        return list(self._state)

    def state_shapes(self) -> list[torch.Size]:
        return [s for _, _, s, _ in self._layout]

    def load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Install a state (from ``state_tensors()`` or a tentative step, of this peer or another)."""
        self._state = self._checked_state(tensors)

    def _checked_state(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != len(self._layout):
            raise ValueError(f"outer optimizer {self.name} has {len(self._layout)} state tensors, got {len(tensors)}.")
        out = []
        for t, (i, key, shape, dtype) in zip(tensors, self._layout):
            if t.shape != shape:
                raise ValueError(
                    f"outer state {key} of parameter {i}: shape {tuple(t.shape)}, expected {tuple(shape)}."
                )
            out.append(t.detach().to(device="cpu", dtype=dtype).contiguous())
        return out

    # ---- steps ------------------------------------------------------------------------------------

    def tentative_step(
        self,
        params: Sequence[torch.Tensor],
        avg_delta: Sequence[torch.Tensor],
        indices: Sequence[int] | None = None,
        state: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Pure: (new params, new state) after one step of the parameters ``indices`` (default: all)
        with ``avg_delta`` (one tensor per index) as their gradient, from ``state`` (default: the held
        one).  Untouched parameters and state tensors are passed through as the same objects."""
        indices = list(range(len(self.shapes))) if indices is None else list(indices)
        if len(params) != len(self.shapes):
            raise ValueError(f"outer optimizer expects {len(self.shapes)} parameters, got {len(params)}.")
        if len(avg_delta) != len(indices):
            raise ValueError(f"got {len(avg_delta)} averaged deltas for {len(indices)} parameters.")
        state = self._state if state is None else self._checked_state(state)
        new_params, new_state = list(params), list(state)
        if self.name == NESTEROV:
            cfg = self.config
            stepped, momentum = outer_step(
                [params[i] for i in indices],
                avg_delta,
                [state[i] for i in indices],
                lr=cfg.lr,
                momentum_coef=cfg.momentum,
                nesterov=cfg.nesterov,
            )
            for i, p, m in zip(indices, stepped, momentum):
                new_params[i], new_state[i] = p, m
            return new_params, new_state

        leaves = []
        for i, g in zip(indices, avg_delta):
            if g.shape != self.shapes[i] or params[i].shape != self.shapes[i]:
                raise ValueError(f"shape mismatch in the outer step of parameter {i}.")
            leaf = torch.nn.Parameter(as_cpu_f32(params[i]).clone())
            leaf.grad = as_cpu_f32(g).clone()
            leaves.append(leaf)
        opt = self._cls(leaves, **self._kwargs)
        for leaf, i in zip(leaves, indices):
            flag, *values = (state[pos] for pos in self._slots[i])
            if bool(flag):
                keys = [self._layout[pos][1] for pos in self._slots[i][1:]]
                opt.state[leaf] = {k: v.clone() for k, v in zip(keys, values)}
        opt.step()
        for leaf, i in zip(leaves, indices):
            slots = self._slots[i]
            got = opt.state[leaf]
            keys = [self._layout[pos][1] for pos in slots[1:]]
            if sorted(got) != keys:
                raise RuntimeError(f"{self.name} state keys changed from {keys} to {sorted(got)}")
            new_state[slots[0]] = torch.tensor(1.0, dtype=_F32)
            for pos, key in zip(slots[1:], keys):
                new_state[pos] = got[key].detach().clone()
            new_params[i] = leaf.detach()
        return new_params, self._checked_state(new_state)

    def step(
        self, params: Sequence[torch.Tensor], avg_delta: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """One step: returns the new params and keeps the new state."""
        new_params, self._state = self.tentative_step(params, avg_delta, indices)
        return new_params
