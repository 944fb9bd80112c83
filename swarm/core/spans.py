"""Element spans of parameter tensors: a streaming fragment is a list of ``Span`` (elements
[start, stop) of one parameter, counted in its flattened row-major order), so a fragment can hold part
of a tensor. Here: reading spans out of tensors, writing them back, and the outer step of spans.

A span that covers its whole tensor is read and stepped as that tensor, with the same ops as before
spans existed, so the whole-tensor patterns compute the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from swarm.config import NESTEROV
from swarm.core.average import as_cpu_f32
from swarm.core.outer import OuterOptimizer, outer_step


@dataclass(frozen=True)
class Span:
    """Elements [start, stop) of parameter ``param`` (its index in model order), flattened row-major."""

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def whole(shapes: Sequence[torch.Size], indices: Sequence[int]) -> list[Span]:
    """One span per parameter ``indices``, each covering its whole tensor."""
    return [Span(i, 0, torch.Size(shapes[i]).numel()) for i in indices]


def is_whole(span: Span, tensor: torch.Tensor) -> bool:
    return span.start == 0 and span.stop == tensor.numel()


def gather(tensors: Sequence[torch.Tensor], spans: Sequence[Span]) -> list[torch.Tensor]:
    """Each span of ``tensors`` as fp32 CPU: the tensor itself (shaped) for a whole span, else a 1-D view."""
    out = []
    for s in spans:
        t = as_cpu_f32(tensors[s.param])
        out.append(t if is_whole(s, t) else t.reshape(-1)[s.start : s.stop])
    return out


@torch.no_grad()
def write(tensors: Sequence[torch.Tensor], spans: Sequence[Span], values: Sequence[torch.Tensor]) -> None:
    """Copy ``values`` (one per span, as ``gather`` shapes them) into the spans of ``tensors`` in place."""
    for s, v in zip(spans, values, strict=True):
        t = tensors[s.param]
        if is_whole(s, t):
            t.copy_(v)
        else:
            t.view(-1)[s.start : s.stop].copy_(v)


def splits_tensors(spans_by_fragment: Sequence[Sequence[Span]], shapes: Sequence[torch.Size]) -> bool:
    """Whether some fragment holds only part of a tensor."""
    return any(
        s.start != 0 or s.stop != torch.Size(shapes[s.param]).numel() for spans in spans_by_fragment for s in spans
    )


def check_outer(
    outer_name: str, pattern: str, spans_by_fragment: Sequence[Sequence[Span]], shapes: Sequence[torch.Size]
) -> None:
    """ValueError when the fragments split tensors and the outer optimizer cannot step parts of them."""
    if outer_name != NESTEROV and splits_tensors(spans_by_fragment, shapes):
        raise ValueError(
            f"[rounds] fragment_pattern = {pattern!r} splits tensors between fragments, which the"
            f' {outer_name} outer optimizer cannot step; use [outer] name = "nesterov" or the'
            " strided or contiguous pattern."
        )


def tentative_step(
    outer: OuterOptimizer, params: Sequence[torch.Tensor], avg_delta: Sequence[torch.Tensor], spans: Sequence[Span]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pure: (new params, new outer state) after one outer step of ``spans`` with ``avg_delta`` (one
    tensor per span, shaped as ``gather`` gives them). Whole spans step through the optimizer as whole
    parameters; a part of a tensor needs an elementwise optimizer (Nesterov: its state is one momentum
    tensor per parameter, and each element's step reads only that element), and the rest of the tensor
    and its momentum are kept. Untouched parameters and state tensors stay the same objects."""
    partial = [k for k, s in enumerate(spans) if not is_whole(s, params[s.param])]
    full = [k for k, s in enumerate(spans) if is_whole(s, params[s.param])]
    if partial and outer.name != NESTEROV:
        raise ValueError(
            f"outer optimizer {outer.name} cannot step part of a tensor; use the nesterov outer"
            " optimizer or a fragment pattern that keeps tensors whole."
        )
    new_params, new_state = outer.tentative_step(params, [avg_delta[k] for k in full], [spans[k].param for k in full])
    if not partial:
        return new_params, new_state
    cfg = outer.config
    for k in partial:
        s = spans[k]
        p = as_cpu_f32(new_params[s.param]).reshape(-1)
        m = new_state[s.param].reshape(-1)
        stepped, momentum = outer_step(
            [p[s.start : s.stop]],
            [avg_delta[k]],
            [m[s.start : s.stop]],
            lr=cfg.lr,
            momentum_coef=cfg.momentum,
            nesterov=cfg.nesterov,
        )
        new_params[s.param] = _replaced(p, s, stepped[0]).view(params[s.param].shape)
        new_state[s.param] = _replaced(m, s, momentum[0]).view(new_state[s.param].shape)
    return new_params, new_state


def _replaced(flat: torch.Tensor, span: Span, value: torch.Tensor) -> torch.Tensor:
    """A copy of the 1-D ``flat`` with ``span`` set to ``value`` (the input is never modified)."""
    out = flat.clone()
    out[span.start : span.stop] = value
    return out
