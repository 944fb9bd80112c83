"""What the owner of a slice does with the slices it receives: cap the declared weights, decode each
contribution (refusing malformed or non-finite ones), reduce them by the run's aggregation rule in the
group's order, and encode the result once, so every member receives identical bytes
(``swarm.net.exchange.allreduce`` moves the bytes). Any failure is an ``ExchangeFailed`` with one sentence."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from swarm.core.aggregation import Aggregation, Reduced
from swarm.core.average import butterfly_bounds, owner_encode, part_bounds
from swarm.core.codecs.codec_base import Codec, all_finite
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.net.bulk.chunk_stream import SlicePayload, settle
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.withdrawal import present, renumbered, withdrawn
from swarm.v1 import exchange_pb2

logger = logging.getLogger("swarm.net.exchange.allreduce")  # the exchange's log, where these lines always were


def slice_bounds(
    numel: int, parts: int, align: int, shares: Optional[Sequence[float]] = None, stripes: int = 1
) -> list[tuple[int, int]]:
    """The butterfly's slices [start, end) of ``numel`` elements (``butterfly_bounds``): in each of ``stripes``
    stripes one per group position, equal (``part_bounds``) without ``shares``, else as near ``shares`` (one
    positive weight per position) as whole blocks of ``align`` allow; slice i is position i % parts's.
    Every boundary but the last is block-aligned, so the slices quantize like the whole vector; the bounds
    depend only on the arguments, so members with the same shares cut the same slices."""
    return butterfly_bounds(numel, parts, align, stripes, lambda n: _cut(n, parts, align, shares))


def _cut(numel: int, parts: int, align: int, shares: Optional[Sequence[float]]) -> list[tuple[int, int]]:
    """One stripe's slices, one per position (``slice_bounds``)."""
    if not shares:
        return part_bounds(numel, parts, align)
    if len(shares) != parts or not all(math.isfinite(s) and s > 0 for s in shares):
        raise ValueError(f"need {parts} positive finite shares, got {list(shares)}.")
    blocks = -(-numel // align)
    total = math.fsum(shares)
    bounds, start, cumulative = [], 0, 0.0
    for share in shares:
        cumulative += share  # Python floats in group order: every member rounds the same boundaries
        end = min(numel, round(blocks * min(1.0, cumulative / total)) * align)
        bounds.append((start, max(start, end)))
        start = max(start, end)
    bounds[-1] = (bounds[-1][0], numel)
    return bounds


def group_bounds(
    key: str, numel: int, parts: int, align: int, shares: Optional[Sequence[float]], stripes: int = 1
) -> list[tuple[int, int]]:
    """``slice_bounds``, its ValueError an ExchangeFailed."""
    try:
        return slice_bounds(numel, parts, align, shares, stripes)
    except ValueError as e:
        raise ExchangeFailed(f"{key}: {e}") from None


def check_agreement(key: str, group: list[Member], me: Member) -> None:
    """ExchangeFailed unless every member posted the same exchange protocol, vector size, codec and controller
    choice."""
    other = next((m for m in group if m.protocol != me.protocol), None)
    if other is not None:
        raise ExchangeFailed(
            f"{key}: groupmate {other.peer_id} runs another version of the exchange (protocol "
            f"{other.protocol or 'unset: an older release'}, this peer {me.protocol}): every peer of a "
            "run must run the same Swarm release; upgrade the older one"
        )
    if any(m.numel != me.numel or m.codec != me.codec for m in group):
        raise ExchangeFailed(f"{key}: groupmates disagree on the vector size or codec")
    if any(m.plan != me.plan for m in group):
        raise ExchangeFailed(
            f"{key}: groupmates hold different controller choices for this round (codec or "
            "shares); each must take the coordinator's choice for the round"
        )


def capped_weights(aggregation: Aggregation, group: list[Member], key: str) -> list[float]:
    """The members' declared weights, capped; a weight that is not positive and finite fails the exchange."""
    try:
        return aggregation.weights([m.weight for m in group], [m.peer_id for m in group])
    except ValueError as e:
        raise ExchangeFailed(f"{key}: {e}") from None


def reduce_slice(
    aggregation: Aggregation, codec, contributions: list[bytes], weights: list[float], numel: int, key: str
) -> tuple[bytes, Reduced]:
    """Decode every contribution to this peer's slice, reduce them by the run's rule in the group's
    order, encode."""
    return reduce_decoded(
        aggregation, codec, [decode_slice(codec, data, numel, key) for data in contributions], weights, key
    )


def reduce_decoded(
    aggregation: Aggregation,
    codec,
    decoded: list[torch.Tensor],
    weights: list[float],
    key: str,
    *,
    owner: Optional[OwnerFeedback] = None,
    bounds: Optional[tuple[int, int]] = None,
    out: Optional[torch.Tensor] = None,
) -> tuple[bytes, Reduced]:
    """``reduce_slice`` on contributions already decoded (each as it arrived). With ``owner`` (this
    peer's residual for its slice ``bounds``) and a codec that asks for owner feedback, the residual is
    added before encoding and the new one staged (``average.owner_encode``). ``out``: where a mean is
    written (``Aggregation.reduce``)."""
    reduced = aggregation.reduce(decoded, weights, out=out)
    try:
        return owner_encode(codec, reduced.average, bounds or (0, 0), owner), reduced
    except ValueError as e:  # non-finite values: never sent, never applied
        raise ExchangeFailed(f"{key}: cannot encode this slice ({e})") from None


def reduce_owned(
    aggregation: Aggregation,
    codec,
    decoded: list[Optional[torch.Tensor]],
    weights: list[float],
    key: str,
    *,
    owner: Optional[OwnerFeedback],
    bounds: tuple[int, int],
    out: torch.Tensor,
) -> tuple[SlicePayload, Reduced]:
    """An owner's slice ``bounds`` reduced (``reduce_decoded``) into ``out``, its place in the result (it may be
    one of ``decoded``: this peer's own contribution, whose memory the result takes), which then holds what every
    member decodes of it; and what the owner sends. fp32 without owner feedback sends ``out``'s own bytes (its
    encoding is its values: the same bits, no encoded copy); any other codec sends the encoded mean, and ``out``
    is then decoded from those bytes. A None in ``decoded`` is a withdrawn member's (``swarm.net.exchange.withdrawal``):
    the reduction is over the others, with their weights."""
    kept = present(key, decoded)
    if len(kept) < len(decoded):
        payload, reduced = reduce_owned(
            aggregation,
            codec,
            [decoded[i] for i in kept],
            [weights[i] for i in kept],
            key,
            owner=owner,
            bounds=bounds,
            out=out,
        )
        return payload, renumbered(reduced, kept)
    if not (_raw_fp32(codec) and (owner is None or not codec.owner_feedback)):
        data, reduced = reduce_decoded(aggregation, codec, decoded, weights, key, owner=owner, bounds=bounds, out=out)
        decode_into(codec, data, out, key)
        return SlicePayload(data), reduced
    reduced = aggregation.reduce(decoded, weights, out=out)
    if reduced.average is not out:  # a rule that makes its own tensor (the trimmed mean)
        out.copy_(reduced.average)
    check_sendable(codec, out, key)  # what the encoding would refuse: a mean that overflowed
    return SlicePayload.lazy(codec, out), Reduced(_NO_AVERAGE, reduced.rejected, reduced.clipped)


_NO_AVERAGE = torch.empty(0)  # a reduction whose average is in its ``out``


def raw_fp32(codec) -> bool:
    """Whether the codec's bytes are the fp32 values themselves (decode(encode(x)) is x, bit for bit)."""
    return _raw_fp32(codec)


def check_sendable(codec, flat: torch.Tensor, key: str) -> None:
    """ExchangeFailed, as ``encode_slice`` would raise it, unless every slice of ``flat`` can be encoded:
    checked once before any part is sent, so a vector that cannot go is never partly sent."""
    try:
        codec._check_input(flat)
    except ValueError as e:
        raise ExchangeFailed(f"{key}: cannot encode this slice ({e})") from None


def judged(key: str, group: list[Member], *reductions: Reduced) -> tuple[dict[str, str], dict[str, str]]:
    """The reductions' verdicts (this peer's slices: one per stripe) by peer id, the first reason for each, each
    logged once."""
    rejected, clipped = {}, {}
    for reduced in reductions:
        for verdicts, into in ((reduced.rejected, rejected), (reduced.clipped, clipped)):
            for i, why in verdicts.items():
                into.setdefault(group[i].peer_id, why)
    for peer_id, why in rejected.items():
        logger.warning("%s: the slice from %s was left out of this peer's part of the average (%s)", key, peer_id, why)
    for peer_id, why in clipped.items():
        logger.info("%s: the slice from %s was %s", key, peer_id, why)
    return rejected, clipped


def encode_slice(codec, tensor: torch.Tensor, key: str) -> bytes:
    try:
        return codec.encode(tensor)
    except ValueError as e:  # non-finite values: never sent, never applied
        raise ExchangeFailed(f"{key}: cannot encode this slice ({e})") from None


def decode_slice(codec, data: bytes | memoryview, numel: int, key: str) -> torch.Tensor:
    """The slice's values; fp32 bytes in a ``memoryview`` (the bulk channel's buffer, this peer's own slice of
    its vector) are read where they lie, without the codec's copy (the reduction only reads them)."""
    if read_in_place(codec, data, numel):
        return torch.from_numpy(_checked(codec, key, lambda: np.frombuffer(data, dtype="<f4")))
    return torch.from_numpy(_checked(codec, key, lambda: codec.decode(data, numel).numpy()))


def decode_into(codec, data: bytes | memoryview, out: torch.Tensor, key: str) -> None:
    """``decode_slice`` written into ``out`` (the exchange's result, where this slice goes) by the codec's
    ``decode_into``: no temporary, no second copy."""
    values = out.numpy()

    def into() -> np.ndarray:
        codec.decode_into(data, values)
        return values

    _checked(codec, key, into)


def _checked(codec, key: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
    """``decode()``'s values, or ExchangeFailed saying what the groupmate sent wrong: bytes the codec refuses, or
    non-finite values (checked here unless the codec's decode refuses those itself)."""
    try:
        values = decode()
    except ValueError as e:
        raise ExchangeFailed(f"{key}: a groupmate sent a malformed slice ({e})") from None
    if not codec.decodes_finite and not all_finite(values):  # numpy's check is ~100x faster than torch's
        raise ExchangeFailed(f"{key}: a groupmate sent non-finite values")
    return values


def read_in_place(codec, data: bytes | memoryview, numel: int) -> bool:
    """Whether ``decode_slice`` reads ``data``'s values where they lie (fp32 in a writable buffer): no copy."""
    return _raw_fp32(codec) and isinstance(data, memoryview) and not data.readonly and len(data) == 4 * numel


def decodes_into(codec) -> bool:
    """Whether the codec decodes straight into a given array (else its ``decode_into`` decodes and copies)."""
    return type(codec).decode_into is not Codec.decode_into


def _raw_fp32(codec) -> bool:
    return getattr(codec, "element_bytes", 0) == 4 and codec.lossless


async def received_slice(
    inbox: Any, scratch: Any, key: str, group: list[Member], codec, slot: tuple, numel: int
) -> Optional[torch.Tensor]:
    """The slice ``slot`` (digest, phase, part, sender position) once ``inbox`` (the exchange's ``SliceInbox``) has
    it, decoded: read where it lies when it can be, else into memory from ``scratch`` (a ``ResultVectors``: what the
    last stripe's decodes let go, no page faults); None when its sender withdrew (``swarm.net.exchange.withdrawal``)."""
    (data,) = await _taken(inbox, key, group, slot)
    if withdrawn(data):
        return None
    if read_in_place(codec, data, numel) or not decodes_into(codec):
        return await asyncio.to_thread(decode_slice, codec, data, numel, key)
    out = scratch.take(numel)
    await asyncio.to_thread(decode_into, codec, data, out, key)
    return out


async def received_into(
    inbox: Any,
    key: str,
    group: list[Member],
    codec,
    slot: tuple,
    out: torch.Tensor,
    free: Optional[asyncio.Event] = None,
) -> None:
    """The slice ``slot`` (digest, phase, part, sender position) decoded into ``out`` once ``inbox`` has it (and
    ``free`` is set: nothing reads ``out``'s values any more)."""
    (data,) = await _taken(inbox, key, group, slot)
    if free is not None:
        await free.wait()
    await asyncio.to_thread(decode_into, codec, data, out, key)


async def averaged_into(
    inbox: Any,
    average: torch.Tensor,
    key: str,
    group: list[Member],
    codec,
    digest: str,
    bounds: list[tuple[int, int]],
    position: int,
    sent_parts: Optional[dict[int, asyncio.Event]],
) -> None:
    """Every other owner's averaged slice of a butterfly exchange, decoded into its place in ``average`` as it
    arrives; with ``sent_parts``, each once that slice's event is set (this peer's contribution to it is sent)."""
    k = len(group)
    await settle(
        received_into(
            inbox,
            key,
            group,
            codec,
            (digest, exchange_pb2.PHASE_AVERAGED, part, part % k),
            average[s:e],
            sent_parts[part] if sent_parts is not None else None,
        )
        for part, (s, e) in enumerate(bounds)
        if part % k != position
    )


async def _taken(inbox: Any, key: str, group: list[Member], slot: tuple) -> list[bytes | memoryview]:
    """The slice ``slot`` once it is here, no longer held by the inbox: its buffer goes once its reader lets go."""
    wanted = (*slot, group[slot[3]].dht_peer_id)
    found = await inbox.wait_for(key, [wanted], group)
    inbox.let_go(key, wanted)
    return found
