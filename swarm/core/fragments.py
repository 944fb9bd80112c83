"""Streaming DiLoCo's pure pieces: which parameters form each fragment, when each fragment syncs, and
how an arrived global fragment is merged into the local parameters.

Rounds and fragments. A round syncs one fragment; with F fragments and H inner steps per full sync,
round r (1, 2, …) syncs fragment ``(r − 1) % F`` after inner step ``((r − 1) // F)·H + (f + 1)·H // F``
(counting steps from 1), i.e. fragment f syncs whenever ``step % H == (f + 1)·H // F % H``: every
fragment exactly once per H steps, staggered, the last one on the full-sync boundary. This is
torchft's order (fragment = commits so far mod F, one sync every H // F steps when F divides H) and
Streaming DiLoCo's staggered offsets. As in both, the first sync of fragment f spans only
(f + 1)·H // F steps; after that each fragment's pseudo-gradient spans H steps. F = 1 is DiLoCo.

Fragments. Parameters are grouped into layer units (the parameters of one transformer block, i.e.
names sharing their first ``.<number>.``; embeddings join the first block, the final norm the last;
a model without numbered blocks has one unit per parameter), and units are
dealt to fragments either **strided** (unit u → fragment u mod F; Streaming DiLoCo's choice, which
mixes shallow and deep layers in every fragment and was slightly better in the paper) or
**contiguous** (F runs of consecutive units with near-equal element counts; torchft's model
fragments). Every parameter is in exactly one fragment. Whole units cannot balance a model whose
embeddings are large next to a block: the fragment holding them is the biggest, and it sets the peak
bytes of a sync.

**Balanced** cuts the flat parameter vector (model order) instead: into F·m pieces of near-equal
element counts, every cut on a multiple of the codec block (``swarm.core.codecs.codec_base.BLOCK``) when the
model has at least F·m blocks, and deals them strided (piece k → fragment k mod F). A piece may end
inside a tensor, so a fragment is a list of element spans (``swarm.core.spans``), and a tensor may be
split between two fragments; its elements are stepped and merged separately, which needs an elementwise
outer optimizer (Nesterov). m is the number of layer units per fragment (at least 1), so a piece is
about one unit and the dealing is Streaming DiLoCo's strided one at layer granularity, made exact in
element counts: the paper found strided slightly better than sequential, because every fragment then
mixes shallow and deep layers. With at most 2F − 1 units (the benchmark's 4 blocks at F = 4) m = 1 and
the pieces are F contiguous ranges. Finer striding (pieces far smaller than a layer) would spread each
fragment over every tensor; it was not measured and costs a span per piece.
"""

from __future__ import annotations

import re
from typing import Sequence, Union

import torch

from swarm.core import spans as span_ops
from swarm.core.codecs.codec_base import BLOCK
from swarm.core.spans import Span

_BLOCK_INDEX = re.compile(r"\.(\d+)\.")

ParamSpec = Union[str, torch.Size, tuple, "tuple[str, torch.Size]"]


def _describe(params: Sequence[ParamSpec]) -> tuple[list[str | None], list[int | None]]:
    """Names and element counts of a list of names, shapes, or (name, shape) pairs."""
    names: list[str | None] = []
    sizes: list[int | None] = []
    for p in params:
        if isinstance(p, str):
            names.append(p)
            sizes.append(None)
        elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            names.append(p[0])
            sizes.append(torch.Size(p[1]).numel())
        else:
            names.append(None)
            sizes.append(torch.Size(p).numel())
    return names, sizes


def layer_units(params: Sequence[ParamSpec]) -> list[list[int]]:
    """Consecutive parameter indices that belong together: one transformer block's parameters (same
    first ``.<number>.`` in their names).  Parameters outside the blocks join their neighbouring block
    (embeddings the first, the final norm and head the last), so fragments of equal block counts have
    near-equal sizes.  Without numbered names (or given shapes), every parameter is its own unit."""
    names, _ = _describe(params)
    keys: list[str | None] = []
    for name in names:
        match = _BLOCK_INDEX.search(name) if name else None
        keys.append(name[: match.end()] if match else None)
    if all(k is None for k in keys):
        return [[i] for i in range(len(names))]
    first = next(k for k in keys if k is not None)
    previous = first
    for i, key in enumerate(keys):
        if key is None:
            keys[i] = previous
        previous = keys[i]
    units: list[list[int]] = []
    for i, key in enumerate(keys):
        if i > 0 and key == keys[i - 1]:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _deal_strided(units: list[list[int]], weight: list[int], num_fragments: int) -> list[list[list[int]]]:
    """Unit u to fragment u mod F."""
    return [units[f::num_fragments] for f in range(num_fragments)]


def _deal_contiguous(units: list[list[int]], weight: list[int], num_fragments: int) -> list[list[list[int]]]:
    """F runs of consecutive units whose total weights are as near equal as whole units allow."""
    total = sum(weight)
    cuts, cumulative, u = [0], 0, 0
    for f in range(1, num_fragments):
        # cut where the running total is nearest f/F of the whole (a unit goes left when its midpoint
        # does), leaving every fragment at least one unit
        while u < len(units) and (2 * cumulative + weight[u]) * num_fragments <= 2 * total * f:
            cumulative += weight[u]
            u += 1
        cut = min(max(u, cuts[-1] + 1), len(units) - (num_fragments - f))
        cumulative = sum(weight[:cut])
        u = cut
        cuts.append(cut)
    cuts.append(len(units))
    return [units[a:b] for a, b in zip(cuts, cuts[1:])]


# The patterns that deal whole layer units, by name.
_DEALS = {"strided": _deal_strided, "contiguous": _deal_contiguous}
BALANCED = "balanced"
# The fragment patterns by name (swarm.config.FRAGMENT_PATTERNS lists the same names).
PATTERNS = (*_DEALS, BALANCED)


def _check_pattern(pattern: str) -> None:
    if pattern not in PATTERNS:
        raise ValueError(f"fragment pattern {pattern!r} is unknown; choose one of {list(PATTERNS)}.")


def fragments(params: Sequence[ParamSpec], num_fragments: int, pattern: str = "strided") -> list[list[int]]:
    """Parameter indices of each fragment (ascending), for parameters given as names, shapes, or
    (name, shape) pairs in model order. For "balanced" (which needs shapes) the parameters a fragment
    holds elements of: a tensor split between two fragments is listed in both. ValueError when there are
    fewer layer units (balanced: elements) than fragments."""
    _check_pattern(pattern)
    if pattern == BALANCED:
        return [sorted({s.param for s in group}) for group in fragment_spans(params, num_fragments, pattern)]
    units = layer_units(params)
    if not 1 <= num_fragments <= len(units):
        raise ValueError(
            f"{num_fragments} fragments need at least as many layer units; this model has"
            f" {len(units)}: lower [rounds] fragments."
        )
    _, sizes = _describe(params)
    weight = [sum(1 if sizes[i] is None else sizes[i] for i in unit) for unit in units]  # elements per unit
    groups = _DEALS[pattern](units, weight, num_fragments)
    return [sorted(i for unit in group for i in unit) for group in groups]


def fragment_spans(
    params: Sequence[ParamSpec], num_fragments: int, pattern: str = "strided", *, pieces_per_fragment: int | None = None
) -> list[list[Span]]:
    """The element spans of each fragment, in model order, for parameters given as shapes or (name,
    shape) pairs: whole tensors for "strided" and "contiguous", F·m block-aligned pieces dealt strided
    for "balanced" (m = ``pieces_per_fragment``, default the layer units per fragment, at least 1)."""
    _check_pattern(pattern)
    _, sizes = _describe(params)
    if any(n is None for n in sizes):
        raise ValueError("fragment spans need the parameters' shapes, not only their names.")
    shapes = [torch.Size([n]) for n in sizes]
    if pattern != BALANCED:
        return [span_ops.whole(shapes, group) for group in fragments(params, num_fragments, pattern)]
    if pieces_per_fragment is None:
        pieces_per_fragment = max(1, len(layer_units(params)) // max(1, num_fragments))
    return _balanced(sizes, num_fragments, pieces_per_fragment)


def _balanced(sizes: list[int], num_fragments: int, pieces_per_fragment: int) -> list[list[Span]]:
    total, pieces = sum(sizes), num_fragments * pieces_per_fragment
    if num_fragments < 1 or pieces_per_fragment < 1 or pieces > total:
        raise ValueError(
            f"{num_fragments} fragments of {pieces_per_fragment} pieces need at least {pieces}"
            f" parameter elements; this model has {total}: lower [rounds] fragments."
        )
    unit = BLOCK if total // BLOCK >= pieces else 1  # tiny models: element cuts, unaligned
    units_total = total // unit
    cuts = [(2 * k * units_total + pieces) // (2 * pieces) * unit for k in range(pieces)] + [total]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    groups: list[list[Span]] = [[] for _ in range(num_fragments)]
    for k in range(pieces):
        group = groups[k % num_fragments]
        for i, n in enumerate(sizes):
            lo, hi = max(cuts[k], starts[i]), min(cuts[k + 1], starts[i] + n)
            if lo >= hi:
                continue
            if group and group[-1].param == i and group[-1].stop == lo - starts[i]:
                group[-1] = Span(i, group[-1].start, hi - starts[i])  # adjacent pieces (F = 1) rejoin
            else:
                group.append(Span(i, lo - starts[i], hi - starts[i]))
    return groups


def round_fragment(round_no: int, num_fragments: int) -> int:
    """The fragment round ``round_no`` (1-based) syncs."""
    if round_no < 1:
        raise ValueError(f"rounds are numbered from 1, got {round_no}.")
    return (round_no - 1) % num_fragments


def round_end_step(round_no: int, inner_steps: int, num_fragments: int) -> int:
    """Inner steps done by a full-speed peer when round ``round_no`` syncs (0 for round 0)."""
    if round_no == 0:
        return 0
    period, f = divmod(round_no - 1, num_fragments)
    return period * inner_steps + (f + 1) * inner_steps // num_fragments


def round_steps(round_no: int, inner_steps: int, num_fragments: int) -> int:
    """Inner steps a full-speed peer runs in round ``round_no``: H // F or H // F + 1."""
    return round_end_step(round_no, inner_steps, num_fragments) - round_end_step(
        round_no - 1, inner_steps, num_fragments
    )


def merge_fragment(
    local: Sequence[torch.Tensor], global_new: Sequence[torch.Tensor], alpha: float
) -> list[torch.Tensor]:
    """α·θl + (1 − α)·θg per tensor (new fp32 CPU tensors): Streaming DiLoCo's merge of a fragment whose
    global value arrived while the peer kept training. α = 0 is plain replacement (an exact copy of θg);
    otherwise two roundings per element, in this order: (θl·α) + (θg·fl32(1 − α))."""
    if len(local) != len(global_new):
        raise ValueError(f"got {len(local)} local and {len(global_new)} global tensors.")
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"mixing alpha must be in [0, 1), got {alpha}.")
    out = []
    a = torch.tensor(alpha, dtype=torch.float32)
    b = torch.tensor(1.0 - alpha, dtype=torch.float32)
    for l, g in zip(local, global_new):
        if l.shape != g.shape:
            raise ValueError(f"local and global tensor shapes differ: {tuple(l.shape)} vs {tuple(g.shape)}.")
        g = g.detach().to(device="cpu", dtype=torch.float32)
        if alpha == 0.0:
            out.append(g.clone())
        else:
            out.append((l.detach().to(device="cpu", dtype=torch.float32) * a) + (g * b))
    return out
