"""The average a sparse all-gather delivers (``swarm.net.exchange.sparse_gather``), computed in one process, and
the bytes it moves.

A sparse codec's sum of K contributions is denser than each, so re-encoding an average (the butterfly)
would lose most of it. Instead every member sends its whole encoded vector to every other member; each
member decodes all K in group order and reduces them by the run's rule, with no encoding after the
reduction. Every member decodes the same K byte strings, so every member computes the same average,
bit for bit; the simulator calls this, so a simulated round and a real one agree too."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from swarm.core.average import as_cpu_f32, weighted_average
from swarm.core.codecs.codec import Codec, get_codec


def gather_reference(
    contributions: Sequence[torch.Tensor],
    weights: Sequence[float],
    codec: Codec | str,
    reduce: Callable[[list[torch.Tensor], list[float]], torch.Tensor] = weighted_average,
    pair_bytes: list[list[int]] | None = None,
) -> torch.Tensor:
    """Each contribution encoded whole and decoded, then ``reduce``d in the given (group) order. ``pair_bytes``
    (K × K), when given, receives the payload bytes member i sends member j, counted from the real encodings (a
    ``variable_size`` codec's depend on the values)."""
    codec = get_codec(codec)
    if not contributions:
        raise ValueError("gather_reference needs at least one contribution.")
    numel = contributions[0].numel()
    for c in contributions:
        if c.dim() != 1 or c.numel() != numel:
            raise ValueError(f"contributions must be 1-D with {numel} elements, got {tuple(c.shape)}.")
    encoded = [codec.encode(as_cpu_f32(c).contiguous()) for c in contributions]
    if pair_bytes is not None:
        for i, data in enumerate(encoded):
            pair_bytes[i][:] = [0 if j == i else len(data) for j in range(len(encoded))]
    decoded = [codec.decode(data, numel) for data in encoded]
    return reduce(decoded, list(weights))


def gather_bytes_by_site(numel: int, sites: Sequence[str], codec: Codec | str) -> list[tuple[int, int]]:
    """(to its own site, to other sites): payload bytes each member sends in one all-gather of ``numel``
    elements, its encoded vector once to every other member. Message headers are not counted."""
    size = get_codec(codec).encoded_size(numel)
    out = []
    for i, site in enumerate(sites):
        same = sum(1 for j, other in enumerate(sites) if j != i and other == site)
        out.append((same * size, (len(sites) - 1 - same) * size))
    return out
