"""A group of one: the exchange's average of a single contribution, computed as the butterfly (or the all-gather)
of one member computes it, without the network's machinery (no inbox, no frames, no result vector beside Δ).

The average of one is not the contribution itself: its slice goes through the codec (the butterfly turns what a
lossy codec drops into error feedback's residual in Δ's memory, as every member's own slice), the run's rule
reduces it (a weighted mean of one is ``c × w / w`` in fp32, two roundings), and the owner encodes the mean once
for its groupmates and decodes it as they would. Each step here is the one a one-member exchange takes, so the
result is bit for bit the butterfly's (``swarm.core.average.butterfly_reference``, which the simulator calls) and
the all-gather's (``swarm.core.all_gather.gather_reference``). fp32 skips the encodings, whose bytes are its
values: at 124M parameters that is 1.5 GB of copies and page faults per round less."""

from __future__ import annotations

from typing import Optional

import torch

from swarm.core.aggregation import Aggregation, Reduced
from swarm.core.average import new_f32
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.net.exchange.contributions import encode_own
from swarm.net.exchange.slices.reduction import decode_slice, encode_slice, raw_fp32, reduce_owned


def average_alone(
    aggregation: Aggregation,
    codec,
    flat: torch.Tensor,
    weights: list[float],
    key: str,
    *,
    gathered: bool,
    owner: Optional[OwnerFeedback],
    into_delta: bool,
) -> tuple[torch.Tensor, Reduced]:
    """The average and its reduction for a group of one whose contribution is ``flat`` (1-D contiguous fp32).
    ``gathered``: the run's exchange is the all-gather (the mean is not re-encoded); ``owner``: this peer's
    residual as its slice's owner; ``into_delta``: the result may take ``flat``'s memory (a lossless codec's Δ,
    which nothing reads again). ExchangeFailed, as the exchange would raise it, for a vector it cannot send."""
    numel = flat.numel()  # a vector that cannot be sent fails its encoding, or fp32's mean (reduce_owned), alike
    if raw_fp32(codec):
        decoded = flat  # its bytes are its values: decode(encode(Δ)) is Δ
    elif gathered:
        decoded = decode_slice(codec, encode_slice(codec, flat, key), numel, key)
    else:  # the butterfly's own slice: what the codec drops becomes error feedback's residual in Δ's memory
        decoded = decode_slice(codec, encode_own(codec, flat, 0, numel, key), numel, key)
    out = decoded if decoded is not flat else flat if into_delta else new_f32((numel,))
    if gathered:
        reduced = aggregation.reduce([decoded], weights, out=out)
        return reduced.average, reduced
    _, reduced = reduce_owned(aggregation, codec, [decoded], weights, key, owner=owner, bounds=(0, numel), out=out)
    return out, reduced
