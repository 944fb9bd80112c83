"""The DiLoCo math as pure tensor functions, shared by the peer daemon and the simulator: the pseudo-
gradient, the weighted average and the butterfly all-reduce it is computed by (``butterfly_reference``),
the outer step and the outer optimizer object that holds its state, and the state hash.

Every peer must compute bit-identical global parameters, so each function fixes its exact sequence
of fp32 operations: one rounding per elementwise op, no ``alpha=``, ``addcmul``, ``foreach`` or
fused kernels (their vectorised body and scalar tail may or may not use fused multiply-add, so the
bits could depend on where a slice starts and on the CPU).  The one exception is an outer optimizer
chosen from ``torch.optim`` by name (see ``OuterOptimizer``).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from swarm.codec import Codec, get_codec

if TYPE_CHECKING:
    from swarm.config import OuterOptConfig

log = logging.getLogger(__name__)

_F32 = torch.float32


def _f32(x: float) -> torch.Tensor:
    """A Python float rounded once to fp32, as a 0-dim tensor (the rounding is explicit, not left to
    how torch wraps Python scalars)."""
    return torch.tensor(x, dtype=_F32)


def as_cpu_f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU, in fp32 (``t`` itself when it already is: no copy)."""
    return t.detach().to(device="cpu", dtype=_F32)


def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = θg − θl per tensor, as new fp32 CPU tensors."""
    if len(global_params) != len(local_params):
        raise ValueError(f"got {len(global_params)} global and {len(local_params)} local tensors.")
    out = []
    for g, l in zip(global_params, local_params):
        if g.shape != l.shape:
            raise ValueError(f"global and local tensor shapes differ: {tuple(g.shape)} vs {tuple(l.shape)}.")
        out.append(as_cpu_f32(g) - as_cpu_f32(l))
    return out


def weighted_average(contributions: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i c_i / Σ w_i with a fixed op order, in the order given (callers pass a canonical order).

    Purely elementwise, so computing it on any slice gives exactly the slice of the full result: a
    peer that reduces one part of the vector agrees with one that reduces all of it.
    """
    if len(contributions) != len(weights) or not contributions:
        raise ValueError(f"need one weight per contribution, got {len(contributions)} and {len(weights)}.")
    for w in weights:
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weights must be positive and finite, got {w!r}.")
    shape = contributions[0].shape
    for c in contributions:
        if c.dtype != _F32 or c.shape != shape:
            raise ValueError(f"contributions must be fp32 with one shape {tuple(shape)}, got {c.dtype} {tuple(c.shape)}.")
    total = 0.0
    for w in weights:  # Python float, summed in the given order: every peer gets the same divisor
        total += float(w)
    acc = contributions[0] * _f32(weights[0])
    for c, w in zip(contributions[1:], weights[1:]):
        acc = acc + (c * _f32(w))  # separate mul and add: two roundings, never one FMA
    return acc / _f32(total)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D fp32 CPU tensor holding all elements, in order."""
    if not tensors:
        return torch.empty(0, dtype=_F32)
    return torch.cat([as_cpu_f32(t).reshape(-1) for t in tensors])


def unflatten(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split ``vec`` into tensors shaped like ``like`` (views into ``vec``)."""
    sizes = [t.numel() for t in like]
    if vec.dim() != 1 or vec.numel() != sum(sizes):
        raise ValueError(f"vector of shape {tuple(vec.shape)} does not hold {sum(sizes)} elements.")
    return [part.view(t.shape) for part, t in zip(torch.split(vec, sizes), like)]


def part_bounds(numel: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``parts`` contiguous slices [start, end) covering ``numel`` elements, as equal as whole blocks of
    ``align`` elements allow: every boundary is a multiple of ``align`` except the final ``numel``
    (the first slices get one block more; slices past the last block are empty).  With ``align`` = 1
    these are the nearly equal slices the butterfly all-reduce has always used."""
    if numel < 0 or parts < 1 or align < 1:
        raise ValueError(f"part_bounds needs numel >= 0, parts >= 1 and align >= 1, got {numel}, {parts}, {align}.")
    blocks = -(-numel // align)
    base, extra = divmod(blocks, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = min(numel, start + (base + (1 if i < extra else 0)) * align)
        bounds.append((start, end))
        start = end
    return bounds


def butterfly_reference(
    contributions: Sequence[torch.Tensor],
    weights: Sequence[float],
    codec: Codec | str,
    parts: int | None = None,
) -> torch.Tensor:
    """The average a butterfly all-reduce delivers to every member (``swarm.exchange``), computed in one
    process: each contribution is cut into ``parts`` (default: one per contributor) slices aligned to
    the codec's block; every slice goes over the wire encoded, so its owner reduces the decoded slices
    with ``weighted_average`` in the given (group) order; the owner encodes its averaged slice once and
    every member decodes those same bytes.  The simulator calls this, so a simulated round and a real
    one agree bit for bit."""
    codec = get_codec(codec)
    if not contributions:
        raise ValueError("butterfly_reference needs at least one contribution.")
    numel = contributions[0].numel()
    for c in contributions:
        if c.dim() != 1 or c.numel() != numel:
            raise ValueError(f"contributions must be 1-D with {numel} elements, got {tuple(c.shape)}.")
    bounds = part_bounds(numel, len(contributions) if parts is None else parts, codec.block)
    averaged = []
    for start, end in bounds:
        n = end - start
        decoded = [codec.decode(codec.encode(as_cpu_f32(c[start:end]).contiguous()), n) for c in contributions]
        mean = weighted_average(decoded, weights)
        averaged.append(codec.decode(codec.encode(mean.contiguous()), n))
    return torch.cat(averaged)


def butterfly_bytes_sent(numel: int, group_size: int, codec: Codec | str) -> list[int]:
    """Payload bytes each member (by position) sends in one butterfly all-reduce of ``numel`` elements:
    its encoded slices for the K−1 other owners, then its own averaged slice to each of the K−1 others.
    Message headers are not counted."""
    codec = get_codec(codec)
    sizes = [codec.encoded_size(e - s) for s, e in part_bounds(numel, group_size, codec.block)]
    total = sum(sizes)
    return [total - own + (group_size - 1) * own for own in sizes]


@dataclass
class OuterState:
    """The outer optimizer's state: one momentum buffer per parameter tensor."""

    momentum: list[torch.Tensor]

    @classmethod
    def zeros_like(cls, params: Sequence[torch.Tensor]) -> "OuterState":
        return cls(momentum=[torch.zeros(p.shape, dtype=_F32) for p in params])


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


def state_hash(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> str:
    """First 16 hex chars of sha256 over the shapes and little-endian fp32 bytes of params, then
    momentum: equal hashes mean bit-identical global state."""
    h = hashlib.sha256()
    for group in (params, momentum):
        h.update(struct.pack("<q", len(group)))
        for t in group:
            arr = as_cpu_f32(t).contiguous().numpy().astype("<f4", copy=False)
            h.update(struct.pack("<q", arr.ndim) + struct.pack(f"<{arr.ndim}q", *arr.shape))
            h.update(arr.reshape(-1).view(np.uint8).data)  # no copy: the state may be GBs
    return h.hexdigest()[:16]


# ---- the outer optimizer as an object with hashable state ---------------------------------------

NESTEROV = "nesterov"


def outer_optimizer_names() -> list[str]:
    """Valid ``[outer] name`` values: the explicit Nesterov step, or a ``torch.optim`` class."""
    names = [
        n for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    ]
    return [NESTEROV] + sorted(names)


def torch_optimizer_kwargs(name: str, lr: float, options: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The ``torch.optim`` class called ``name`` and its constructor arguments: ``lr``, the options
    (lists become tuples, e.g. ``betas``), and single-tensor, unfused kernels where it has the switches."""
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


class OuterOptimizer:
    """θg ← OuterOpt(θg, Δ̄), with the optimizer's state held as a fixed list of tensors so it can be
    hashed (``state_hash(params, state_tensors())``), sent to a joining peer and checkpointed.

    ``name = "nesterov"`` (the default) is ``outer_step``: explicit fp32 ops, identical on every
    machine; its state is one momentum buffer per parameter (the layout the project always had).
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
                raise ValueError("[outer] options apply to torch.optim optimizers; nesterov takes lr, momentum, nesterov.")
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
            raise ValueError(f"[outer] optimizer {self.name} cannot step a {tuple(shape)} fp32 CPU parameter ({e}).") from None
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

    def state_names(self) -> list[str]:
        """A name per state tensor, e.g. ``momentum.00003`` or ``00003.exp_avg`` (for checkpoints)."""
        if self.name == NESTEROV:
            return [f"momentum.{i:05d}" for i in range(len(self.shapes))]
        return [f"{i:05d}.{key}" for i, key, _, _ in self._layout]

    def load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Install a state (from ``state_tensors()`` or a tentative step, of this peer or another)."""
        self._state = self._checked_state(tensors)

    def _checked_state(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != len(self._layout):
            raise ValueError(f"outer optimizer {self.name} has {len(self._layout)} state tensors, got {len(tensors)}.")
        out = []
        for t, (i, key, shape, dtype) in zip(tensors, self._layout):
            if t.shape != shape:
                raise ValueError(f"outer state {key} of parameter {i}: shape {tuple(t.shape)}, expected {tuple(shape)}.")
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
            stepped, momentum = outer_step([params[i] for i in indices], avg_delta, [state[i] for i in indices],
                                           lr=cfg.lr, momentum_coef=cfg.momentum, nesterov=cfg.nesterov)
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

    def step(self, params: Sequence[torch.Tensor], avg_delta: Sequence[torch.Tensor],
             indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """One step: returns the new params and keeps the new state."""
        new_params, self._state = self.tentative_step(params, avg_delta, indices)
        return new_params
