"""Low-rank pseudo-gradients (PowerSGD's scheme, Vogels et al. 2019, applied to DiLoCo's Δ): the
``lowrank{r}-{values}`` codecs, e.g. ``lowrank4-fp16``.

Every 2-D parameter M (m×n) of a fragment is sent as two thin matrices, through two ordinary
(exactly averageable) butterfly all-reduces of small vectors:

    1. P_i = M_i Q (m×r) on every peer; the group averages P (the 1-D parameters ride along, dense);
    2. every peer orthonormalizes the same decoded average P̂ (the same bytes, the same ops);
    3. Q_i = M_iᵀ P̂ (n×r); the group averages Q;
    4. every peer applies the update P̂ Q̂ᵀ = P̂ P̂ᵀ · mean(M_i) (Q̂ decoded, so bit-identical).

Bytes per matrix: r(m + n) values instead of m·n. What the projection (and the values' codec) drops
stays in the peer's error-feedback residual, M_i − P̂ P̂ᵀ M_i. Q is warm-started from the last round's
Q̂ (one power iteration per round, as PowerSGD): a peer that has none (the first round, a joiner) starts
from a seeded random Q. Q only steers which subspace P̂ spans; P̂ comes from the averaged bytes, so
peers holding different Qs still apply identical updates.

Every operation after decoding (the Gram–Schmidt, the product P̂ Q̂ᵀ) is a fixed sequence of
elementwise fp32 ops and pairwise-tree sums, never a BLAS call, so every peer computes the same bits
on any CPU. The products before encoding (M_i Q, M_iᵀ P̂) are each peer's own and may round as they like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from swarm.core.average import as_cpu_f32, butterfly_reference, part_bounds, weighted_average
from swarm.core.codecs.codec_base import Codec
from swarm.core.codecs.lowrank_codec import LowRankCodec


@dataclass(frozen=True)
class Layout:
    """How a fragment's flat vector splits: ``matrices`` (offset, m, n) sent as rank-r factors, and
    ``dense`` (offset, numel) parts sent whole (1-D tensors, and matrices too small to gain)."""

    numel: int
    rank: int
    matrices: tuple[tuple[int, int, int], ...]
    dense: tuple[tuple[int, int], ...]

    @property
    def p_numel(self) -> int:
        return sum(m * self.rank for _, m, _ in self.matrices) + sum(n for _, n in self.dense)

    @property
    def q_numel(self) -> int:
        return sum(n * self.rank for _, _, n in self.matrices)


def layout(shapes: Sequence[Sequence[int]], rank: int) -> Layout:
    """The layout of a flat vector holding tensors of ``shapes`` in order."""
    matrices, dense, offset = [], [], 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        if len(shape) == 2 and rank * (shape[0] + shape[1]) < numel:
            matrices.append((offset, int(shape[0]), int(shape[1])))
        elif numel:
            dense.append((offset, numel))
        offset += numel
    return Layout(offset, rank, tuple(matrices), tuple(dense))


def initial_q(lay: Layout, seed: int) -> torch.Tensor:
    """The seeded random Q (all matrices' n×r, flat) a peer without a previous round starts from."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(lay.q_numel, generator=gen, dtype=torch.float32)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over dim 0 by a pairwise tree of elementwise adds (zero-padded to a power of two): the same
    bits on every CPU, unlike ``torch.sum`` whose order follows its vector width."""
    n = x.shape[0]
    size = 1
    while size < n:
        size *= 2
    if size != n:
        x = torch.cat([x, x.new_zeros((size - n, *x.shape[1:]))])
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram–Schmidt on the columns of ``p`` (m×r) with exact-order fp32 ops; a column that
    is (numerically) in the span of the ones before it becomes zero."""
    cols: list[torch.Tensor] = []
    for k in range(p.shape[1]):
        v = p[:, k].clone()
        for u in cols:
            v = v - tree_sum(u * v) * u
        norm = torch.sqrt(tree_sum(v * v))
        cols.append(v / norm if float(norm) > 0 else torch.zeros_like(v))
    return torch.stack(cols, dim=1)


def outer_sum(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Qᵀ (m×r · r×n) as r rank-one products added in order, one rounding per op (no BLAS, no FMA)."""
    acc = p[:, 0:1] * q[:, 0].unsqueeze(0)
    for k in range(1, p.shape[1]):
        acc = acc + p[:, k : k + 1] * q[:, k].unsqueeze(0)
    return acc


def _flat_columns(factor: torch.Tensor) -> torch.Tensor:
    """A factor (rows×r) flattened column by column: a codec block then holds one column, whose scale
    (one singular direction's) can be far from its neighbours'; row-major blocks would quantize the weak
    columns against the strong ones' absmax."""
    return factor.t().reshape(-1)


def _columns(flat: torch.Tensor, rows: int, rank: int) -> torch.Tensor:
    """The rows×r factor that ``_flat_columns`` flattened (a view)."""
    return flat.view(rank, rows).t()


def _unit_columns(q: torch.Tensor) -> torch.Tensor:
    """Q with unit columns (a zero column stays zero): P = M Q then has M's scale whatever Q's was."""
    norms = torch.sqrt((q * q).sum(dim=0))
    return q / torch.where(norms > 0, norms, torch.ones_like(norms))


def p_vector(delta: torch.Tensor, lay: Layout, q: torch.Tensor) -> torch.Tensor:
    """A peer's first message: M Q for every matrix (flat, in order), then the dense parts."""
    parts, q_at = [], 0
    for offset, m, n in lay.matrices:
        mat = delta[offset : offset + m * n].view(m, n)
        qm = _unit_columns(_columns(q[q_at : q_at + n * lay.rank], n, lay.rank))
        parts.append(_flat_columns(mat @ qm))
        q_at += n * lay.rank
    parts += [delta[offset : offset + n] for offset, n in lay.dense]
    return torch.cat(parts) if parts else delta.new_zeros(0)


def p_hats(p_avg: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """The orthonormalized P̂ of every matrix, from the averaged (decoded) first message."""
    out, at = [], 0
    for _, m, _ in lay.matrices:
        out.append(orthonormalize(_columns(p_avg[at : at + m * lay.rank], m, lay.rank)))
        at += m * lay.rank
    return out


def q_vector(delta: torch.Tensor, lay: Layout, hats: Sequence[torch.Tensor]) -> torch.Tensor:
    """A peer's second message: Mᵀ P̂ for every matrix, flat."""
    parts = [
        _flat_columns(delta[offset : offset + m * n].view(m, n).t() @ hat)
        for (offset, m, n), hat in zip(lay.matrices, hats)
    ]
    return torch.cat(parts) if parts else delta.new_zeros(0)


def assemble(lay: Layout, hats: Sequence[torch.Tensor], q: torch.Tensor, p_dense: torch.Tensor) -> torch.Tensor:
    """The full flat vector: P̂ Qᵀ for every matrix, and the dense parts from the first message."""
    out = torch.empty(lay.numel, dtype=torch.float32)
    q_at = 0
    for (offset, m, n), hat in zip(lay.matrices, hats):
        out[offset : offset + m * n] = outer_sum(hat, _columns(q[q_at : q_at + n * lay.rank], n, lay.rank)).reshape(-1)
        q_at += n * lay.rank
    dense_at = sum(m * lay.rank for _, m, _ in lay.matrices)
    for offset, n in lay.dense:
        out[offset : offset + n] = p_dense[dense_at : dense_at + n]
        dense_at += n
    return out


def round_trip(flat: torch.Tensor, codec: Codec, parts: int) -> torch.Tensor:
    """What the group receives of ``flat`` sent as ``parts`` butterfly slices (each encoded on its own)."""
    bounds = part_bounds(flat.numel(), parts, codec.block)
    return (
        torch.cat([codec.decode(codec.encode(flat[s:e].contiguous()), e - s) for s, e in bounds])
        if flat.numel()
        else flat
    )


@dataclass
class LowRankRound:
    """One low-rank exchange's results: the average every peer applies, what each peer's own
    contribution delivered (for its error feedback) and the Q̂ each peer warm-starts from next."""

    average: torch.Tensor
    delivered: list[torch.Tensor]
    q_next: torch.Tensor


def lowrank_reference(
    contributions: Sequence[torch.Tensor],
    weights: Sequence[float],
    codec: LowRankCodec,
    lay: Layout,
    qs: Sequence[torch.Tensor],
    reduce: Callable[[list[torch.Tensor], list[float]], torch.Tensor] = weighted_average,
) -> LowRankRound:
    """The two butterfly all-reduces of a low-rank exchange, computed in one process (the simulator).
    ``qs[i]`` is peer i's warm-start Q."""
    values, k = codec.values, len(contributions)
    deltas = [as_cpu_f32(c) for c in contributions]
    p_msgs = [p_vector(d, lay, q) for d, q in zip(deltas, qs)]
    p_avg = butterfly_reference(p_msgs, weights, values, reduce=reduce)
    hats = p_hats(p_avg, lay)
    q_msgs = [q_vector(d, lay, hats) for d in deltas]
    q_avg = butterfly_reference(q_msgs, weights, values, reduce=reduce)
    average = assemble(lay, hats, q_avg, p_avg)
    delivered = [
        assemble(lay, hats, round_trip(qm, values, k), round_trip(pm, values, k)) for pm, qm in zip(p_msgs, q_msgs)
    ]
    return LowRankRound(average, delivered, q_avg)


class LowRankState:
    """One peer's low-rank state for one fragment: the Q it warm-starts from, and what the round in
    flight staged (the next Q, and what its contribution delivered, for error feedback).

    Written by the exchange's thread (``stage``) and then, after the round's future, by the round
    runner (``commit``/``discard``): never at the same time."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.q: Optional[torch.Tensor] = None
        self._staged: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def q_for(self, lay: Layout) -> torch.Tensor:
        """The last committed Q̂ when it fits ``lay``, else the seeded random start."""
        if self.q is not None and self.q.numel() == lay.q_numel:
            return self.q
        return initial_q(lay, self.seed)

    def stage(self, q_next: torch.Tensor, delivered: torch.Tensor) -> None:
        self._staged = (q_next, delivered)

    def commit(self) -> Optional[torch.Tensor]:
        """The round committed: keep its Q̂; returns what this peer's contribution delivered (None when
        no low-rank exchange staged anything, e.g. the round went out in another codec)."""
        if self._staged is None:
            return None
        (self.q, delivered), self._staged = self._staged, None
        return delivered

    def discard(self) -> None:
        """The round was voided: the previous Q stays."""
        self._staged = None
