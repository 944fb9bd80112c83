"""The DiLoCo math as pure tensor functions, shared by the peer daemon and the simulator.

Every peer must compute bit-identical global parameters, so each function fixes its exact sequence
of fp32 operations: one rounding per elementwise op, no ``alpha=``, ``addcmul``, ``foreach`` or
fused kernels (their vectorised body and scalar tail may or may not use fused multiply-add, so the
bits could depend on where a slice starts and on the CPU).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

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
