"""The DiLoCo averaging math as pure tensor functions, shared by the round runner and the exchange:
the pseudo-gradient, the sample-weighted average and the butterfly all-reduce that computes it
(``butterfly_reference``, bytes in ``butterfly_bytes_sent``), and the flat-vector helpers.

Every peer must compute bit-identical global parameters, so each function fixes its exact sequence
of fp32 operations: one rounding per elementwise op, no ``alpha=``, ``addcmul``, ``foreach`` or
fused kernels (their vectorised body and scalar tail may or may not use fused multiply-add, so the
bits could depend on where a slice starts and on the CPU).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from swarm.core.codecs.codec import Codec, get_codec
from swarm.core.codecs.owner_feedback import OwnerFeedback

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


def flat_pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``flatten(pseudo_gradient(...))`` with the same one subtraction per element, written straight into the one
    flat vector (no per-tensor copies beside it)."""
    if len(global_params) != len(local_params):
        raise ValueError(f"got {len(global_params)} global and {len(local_params)} local tensors.")
    flat = torch.empty(sum(g.numel() for g in global_params), dtype=_F32)
    for out, g, l in zip(unflatten(flat, global_params), global_params, local_params):
        if g.shape != l.shape:
            raise ValueError(f"global and local tensor shapes differ: {tuple(g.shape)} vs {tuple(l.shape)}.")
        torch.sub(as_cpu_f32(g), as_cpu_f32(l), out=out)
    return flat


def check_contributions(contributions: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    """ValueError unless there is one positive finite weight per contribution and the contributions are
    fp32 tensors of one shape."""
    if len(contributions) != len(weights) or not contributions:
        raise ValueError(f"need one weight per contribution, got {len(contributions)} and {len(weights)}.")
    for w in weights:
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weights must be positive and finite, got {w!r}.")
    shape = contributions[0].shape
    for c in contributions:
        if c.dtype != _F32 or c.shape != shape:
            raise ValueError(
                f"contributions must be fp32 with one shape {tuple(shape)}, got {c.dtype} {tuple(c.shape)}."
            )


def new_f32(shape: Sequence[int] | torch.Size) -> torch.Tensor:
    """An uninitialised fp32 CPU tensor in numpy's memory: numpy asks the kernel for huge pages for large
    arrays and torch's allocator does not, so a 100 MB tensor's first writes cost about a quarter."""
    return torch.from_numpy(np.empty(tuple(shape), dtype=np.float32))


AVERAGE_CHUNK = 1 << 16  # elements averaged at a time: the running sum and one scratch stay in the core's cache


def weighted_average(
    contributions: Sequence[torch.Tensor], weights: Sequence[float], *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ w_i c_i / Σ w_i with a fixed op order, in the order given (callers pass a canonical order).

    Purely elementwise, so computing it on any slice gives exactly the slice of the full result: a
    peer that reduces one part of the vector agrees with one that reduces all of it. ``out``: a
    contiguous fp32 tensor of the contributions' shape to write the result into (None: a new one); it may be one
    of them (an owner's own contribution, whose memory the result then takes: each chunk is computed beside it
    and copied in, the same roundings).
    """
    check_contributions(contributions, weights)
    total = 0.0
    for w in weights:  # Python float, summed in the given order: every peer gets the same divisor
        total += float(w)
    acc = out if out is not None else new_f32(contributions[0].shape)
    if acc.dtype != _F32 or acc.shape != contributions[0].shape or not acc.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of shape {tuple(contributions[0].shape)}.")
    # A chunk at a time, the same roundings as ``acc + c * w`` written out (separate mul and add: two roundings,
    # never one FMA): the running sum is read and written once from memory instead of once per contribution,
    # and the products' scratch is a chunk, not a vector (at tens of MB, fresh memory's page faults cost more
    # than the arithmetic).
    flat, parts = acc.view(-1), [c.reshape(-1) for c in contributions]
    scales, divisor = [_f32(w) for w in weights], _f32(total)
    size = min(flat.numel(), AVERAGE_CHUNK)
    scratch = torch.empty(size, dtype=_F32) if len(parts) > 1 else None
    # out is a contribution's memory: a later contribution's chunk must be read before the sum is written over it
    beside = torch.empty(size, dtype=_F32) if len(parts) > 1 and any(_shares(flat, c) for c in parts[1:]) else None
    for start in range(0, flat.numel(), AVERAGE_CHUNK):
        end = min(flat.numel(), start + AVERAGE_CHUNK)
        chunk = flat[start:end] if beside is None else beside[: end - start]
        torch.mul(parts[0][start:end], scales[0], out=chunk)
        for c, w in zip(parts[1:], scales[1:]):
            scaled = scratch[: end - start]
            torch.mul(c[start:end], w, out=scaled)
            chunk.add_(scaled)
        chunk.div_(divisor)
        if beside is not None:
            flat[start:end].copy_(chunk)
    return acc


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fp32 CPU tensors' memory overlaps."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


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
    (the float codecs) the slices differ in length by at most one element."""
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


# A butterfly over a large vector goes in stripes (``butterfly_bounds``): the vector is cut into up to MAX_STRIPES
# consecutive stripes and each stripe into one slice per member, so an owner reduces and sends back its slice of
# stripe 0 while the contributions to stripe 1 are still arriving (the two phases overlap instead of running one
# after the other). A stripe is cut only while every member's slice of it keeps at least STRIPE_MIN_BYTES encoded:
# each slice is one frame (a claim, a connection's turn), which costs more than it overlaps below that.
STRIPE_MIN_BYTES = 192 * 1024
MAX_STRIPES = 8


def stripe_count(codec: Codec | str, numel: int, group_size: int) -> int:
    """How many stripes a butterfly of ``numel`` elements over ``group_size`` members goes in: a function of
    these alone (every member and the simulator derive the same), 1 for small vectors."""
    codec = get_codec(codec)
    if group_size < 2 or numel <= 0:
        return 1
    per_member = codec.encoded_size(-(-numel // group_size))
    return max(1, min(MAX_STRIPES, per_member // STRIPE_MIN_BYTES))


def butterfly_bounds(
    numel: int, group_size: int, align: int, stripes: int = 1, cut: Callable[[int], list[tuple[int, int]]] | None = None
) -> list[tuple[int, int]]:
    """The slices [start, end) of a butterfly, ``stripes`` × ``group_size`` of them: slice i is member
    i % group_size's part of stripe i // group_size. Stripes are ``part_bounds`` of the vector; each stripe is
    cut by ``cut(stripe length)`` (default: equal parts); every boundary but the last is a multiple of
    ``align``, so the slices quantize like the whole vector and a blockwise codec gives the same values in
    stripes as in one piece."""
    cut = cut or (lambda n: part_bounds(n, group_size, align))
    return [(s0 + a, s0 + b) for s0, s1 in part_bounds(numel, stripes, align) for a, b in cut(s1 - s0)]


def butterfly_reference(
    contributions: Sequence[torch.Tensor],
    weights: Sequence[float],
    codec: Codec | str,
    parts: int | None = None,
    reduce: Callable[[list[torch.Tensor], list[float]], torch.Tensor] = weighted_average,
    owners: Sequence[OwnerFeedback | None] | None = None,
    pair_bytes: list[list[int]] | None = None,
) -> torch.Tensor:
    """The average a butterfly all-reduce delivers to every member (``swarm.net.exchange.allreduce``), computed in one
    process: each contribution is cut into ``parts`` slices aligned to the codec's block (default: one per
    contributor in each of ``stripe_count`` stripes, slice i owned by contributor i % K, as the network
    cuts them: ``butterfly_bounds``); every slice goes over the wire encoded, so its owner reduces the decoded
    slices with ``reduce`` (default ``weighted_average``; the exchange's rule, see ``swarm.core.aggregation``)
    in the given (group) order; the owner encodes its averaged slice once and every member decodes those same
    bytes.  ``owners[k]`` (contributor k's, the owner of slices k, k + K, ..., when the codec asks for
    ``owner_feedback``; with ``parts``, one per slice) adds its residual to the average before that encoding
    and stages the new one (``swarm.core.codecs.owner_feedback``).  ``pair_bytes`` (K × K, one row per member), when
    given, receives the payload bytes member i sends member j, counted from the real encodings (a
    ``variable_size`` codec's depend on the values).  The simulator calls this, so a simulated round and a real
    one agree bit for bit."""
    codec = get_codec(codec)
    if not contributions:
        raise ValueError("butterfly_reference needs at least one contribution.")
    numel = contributions[0].numel()
    for c in contributions:
        if c.dim() != 1 or c.numel() != numel:
            raise ValueError(f"contributions must be 1-D with {numel} elements, got {tuple(c.shape)}.")
    k = len(contributions) if parts is None else parts
    bounds = butterfly_bounds(numel, k, codec.block, stripe_count(codec, numel, k) if parts is None else 1)
    if owners is not None and len(owners) != k:
        raise ValueError(f"need one owner feedback (or None) per owner, got {len(owners)} for {k} owners.")
    if pair_bytes is not None and not (k == len(contributions) == len(pair_bytes)):
        raise ValueError("pair_bytes counts a butterfly of one owner per member: K owners, K rows.")
    averaged = []
    for i, (start, end) in enumerate(bounds):
        n, owner_at = end - start, i % k
        payloads = [codec.encode(as_cpu_f32(c[start:end]).contiguous()) for c in contributions]
        decoded = [codec.decode(data, n) for data in payloads]
        mean = reduce(decoded, list(weights))
        owner = owners[owner_at] if owners is not None else None
        data = owner_encode(codec, mean, (start, end), owner)
        if pair_bytes is not None:
            for j, sent in enumerate(payloads):
                if j != owner_at:
                    pair_bytes[j][owner_at] += len(sent)  # member j's slice i to its owner
                    pair_bytes[owner_at][j] += len(data)  # the owner's average back to member j
        averaged.append(codec.decode(data, n))
    return torch.cat(averaged)


def owner_encode(codec: Codec, mean: torch.Tensor, bounds: tuple[int, int], owner: OwnerFeedback | None) -> bytes:
    """The bytes a slice owner sends for its averaged slice ``bounds``: ``mean`` encoded once, with the
    owner's residual added first when ``owner`` is given and the codec asks for it (its new residual is
    staged). The simulator (``butterfly_reference``) and the real exchange (``swarm.net``) both call this."""
    if owner is None or not codec.owner_feedback:
        return codec.encode(mean.contiguous())
    sent = owner.compensate(bounds, mean).contiguous()
    data = codec.encode(sent)
    owner.stage(bounds, sent, codec.decode(data, sent.numel()))
    return data


def owned_bytes(numel: int, group_size: int, codec: Codec | str) -> list[int]:
    """The encoded bytes of the slices each member (by position) owns in a butterfly of ``numel`` elements, over
    all its stripes: the most its contributions to them take, and its averaged slices."""
    codec = get_codec(codec)
    sizes = [0] * group_size
    bounds = butterfly_bounds(numel, group_size, codec.block, stripe_count(codec, numel, group_size))
    for i, (start, end) in enumerate(bounds):
        sizes[i % group_size] += codec.encoded_size(end - start)
    return sizes


def butterfly_bytes_sent(numel: int, group_size: int, codec: Codec | str) -> list[int]:
    """Payload bytes each member (by position) sends in one butterfly all-reduce of ``numel`` elements:
    its encoded slices for the K−1 other owners, then its own averaged slice to each of the K−1 others.
    Message headers are not counted."""
    sizes = owned_bytes(numel, group_size, codec)
    total = sum(sizes)
    return [total - own + (group_size - 1) * own for own in sizes]
