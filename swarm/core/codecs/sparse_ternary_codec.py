"""A sparse ternary wire format with entropy-coded positions, ``ternary@<density>`` (e.g. ``ternary@0.1``):
per block of ``block_for(density)`` elements (1,024 from density 1/32 up; up to 8,192 below), the ⌈density × length⌉ largest-magnitude elements as
±level and the rest as 0, the level being their mean |x| (the value that minimizes the L2 error for that
choice). Positions are Rice codes of the gaps between sent elements (``swarm.core.codecs.rice``), one sign bit
each, so a payload costs about the entropy of the code, H(density) + density bits per element, plus a
fp32 level per block (≤ 0.03 bits): e.g. 0.1 → ~0.6 bits, where ``ternary``'s fixed layout costs 1.725.

Its size depends on where the sent elements fall (``Codec.variable_size``): ``encoded_size`` is the most
``encode`` returns, and the bytes a run sends are counted from the real payloads. Every quantity is
computed with integer or correctly rounded fp32 operations in a fixed order (|x| × 1/block, a pairwise tree
of adds, one multiplication and one division per level), so a sender gets the same bytes on every machine;
which of two equal magnitudes a block keeps is the sender's choice (receivers decode the bytes they got).

Layout: the block levels (fp32, little-endian), then the Rice payload of the gaps with each sent element's
sign as its extra bit (1: −level). Exchanged by the butterfly; a slice owner keeps what re-encoding its
averaged slice lost (``Codec.owner_feedback``), as ``ternary`` and ``sign`` do.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from swarm.core.codecs import rice
from swarm.core.codecs.codec_base import Codec
from swarm.core.codecs.ternary_codec import tree_sums

SPARSE_TERNARY_BLOCK = 1024  # elements per level from density 1/32 up: 32/1024 = 0.03 bits per element
MAX_BLOCK = 8192
MIN_SENT_PER_LEVEL = 32
PREFIX = "ternary@"
_FLT_MAX = np.float32(np.finfo(np.float32).max)


def block_for(density: float) -> int:
    """Elements per level: 1,024, doubled (up to 8,192) until a block sends at least 32 values.

    At a low density a 1,024-element block sends a handful of values, and its fp32 level and the rounding up of
    ⌈density × 1,024⌉ cost as much as their positions: at 0.012, 13 values instead of 12.3 and a level for
    them (~25% of the payload); at 0.003, 4 instead of 3.1 (~40%); below 1/1,024 every block still sends one."""
    block = SPARSE_TERNARY_BLOCK
    while block < MAX_BLOCK and density * block < MIN_SENT_PER_LEVEL:
        block *= 2
    return block


class SparseTernaryCodec(Codec):
    """±level for the ⌈density × length⌉ largest |x| of every block, 0 elsewhere; positions Rice-coded."""

    owner_feedback = True
    variable_size = True

    def __init__(self, density: float) -> None:
        if not (isinstance(density, float) and math.isfinite(density) and 0 < density <= 1):
            raise ValueError(f"a sparse ternary codec's density must be a fraction in (0, 1], got {density!r}.")
        self.density = density
        self.block = block_for(density)
        self._shrink = np.float32(1.0 / self.block)  # a power of two: a tree of ``block`` adds cannot overflow
        self.name = f"{PREFIX}{density:g}"

    def k(self, length: int) -> int:
        return max(1, min(length, math.ceil(self.density * length)))

    def _lengths(self, numel: int) -> np.ndarray:
        lengths = np.full(-(-numel // self.block), self.block, dtype=np.int64)
        if numel % self.block:
            lengths[-1] = numel % self.block
        return lengths

    def _counts(self, numel: int) -> np.ndarray:
        return np.array([self.k(int(n)) for n in self._lengths(numel)], dtype=np.int64)

    def encoded_size(self, numel: int) -> int:
        """The most bytes ``encode`` returns for ``numel`` elements (a payload is usually ~⅔ of it)."""
        numel = max(numel, 0)
        return 4 * -(-numel // self.block) + rice.max_size(int(self._counts(numel).sum()), numel)

    def encode(self, t: torch.Tensor) -> bytes:
        values = self._check_input(t)
        n = values.size
        if n == 0:
            return b""
        lengths = self._lengths(n)
        nb = lengths.size
        magnitude = np.full(nb * self.block, -1.0, dtype=np.float32)  # padding: below every |x|, never picked
        np.abs(values, out=magnitude[:n])
        rows = magnitude.reshape(nb, self.block)
        picked = np.zeros((nb, self.block), dtype=bool)
        for first, last, length in self._sections(lengths):
            k = self.k(length)
            part = rows[first:last]
            chosen = (
                np.argpartition(-part, k - 1, axis=1)[:, :k]
                if k < self.block
                else np.broadcast_to(np.arange(self.block), (last - first, self.block))
            )
            np.put_along_axis(picked[first:last], chosen, True, axis=1)
        kept = np.where(picked, rows, np.float32(0)) * self._shrink  # exact above the subnormals
        counts = picked.sum(axis=1).astype(np.float32)
        sums = tree_sums(kept)
        with np.errstate(over="ignore"):
            levels = ((sums * np.float32(self.block)) / counts).astype("<f4")
        if not np.isfinite(levels).all():  # kept values whose sum passes FLT_MAX (each near it): divide first
            levels = np.where(
                np.isfinite(levels), levels, np.minimum((sums / counts) * np.float32(self.block), _FLT_MAX)
            ).astype("<f4")
        positions = np.flatnonzero(picked.reshape(-1))
        gaps = np.diff(positions, prepend=-1) - 1
        signs = (values[positions] < 0).astype(np.uint8)
        return levels.tobytes() + rice.encode(gaps, signs)

    def _sections(self, lengths: np.ndarray) -> list[tuple[int, int, int]]:
        """(first block, end block, length) of the full blocks and of the short last one."""
        full = int((lengths == self.block).sum())
        out = [(0, full, self.block)] if full else []
        if full < lengths.size:
            out.append((full, lengths.size, int(lengths[-1])))
        return out

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        if numel < 0 or len(data) > self.encoded_size(numel):
            raise ValueError(
                f"codec {self.name}: got {len(data)} bytes for {numel} elements, more than the"
                f" {self.encoded_size(max(numel, 0))} encode writes at most; the payload is corrupt."
            )
        if numel == 0:
            if data:
                raise ValueError(f"codec {self.name}: a payload of no elements must be empty.")
            return torch.zeros(0, dtype=torch.float32)
        counts = self._counts(numel)
        nb = counts.size
        if len(data) < 4 * nb:
            raise ValueError(f"codec {self.name}: the payload is shorter than its {nb} block levels.")
        levels = self._block_scales(data, numel)
        try:
            gaps, signs = rice.decode(data[4 * nb :], int(counts.sum()))
        except ValueError as e:
            raise ValueError(f"codec {self.name}: {e}") from None
        positions = np.cumsum(gaps + 1) - 1
        if positions.size and positions[-1] >= numel:
            raise ValueError(f"codec {self.name}: a position is past the last element; the payload is corrupt.")
        if not np.array_equal(np.bincount(positions // self.block, minlength=nb), counts):
            raise ValueError(f"codec {self.name}: a block does not hold exactly the values its density sends.")
        out = np.zeros(numel, dtype=np.float32)
        level = levels.astype(np.float32)[positions // self.block]
        out[positions] = np.where(signs.astype(bool), -level, level)
        return torch.from_numpy(out)


def parse_sparse_ternary(name: str) -> Optional[SparseTernaryCodec]:
    """The codec ``ternary@0.1`` stands for; None when ``name`` is not of that form."""
    if not name.startswith(PREFIX):
        return None
    try:
        return SparseTernaryCodec(float(name[len(PREFIX) :]))
    except ValueError:
        return None
