"""The all-gather exchange over the butterfly's transport: of sparse (top-k) pseudo-gradients always, and of
every codec in a run whose ``[rounds] exchange`` is the all-gather (the default of a run that admits strangers).

The sum of K sparse vectors is up to K times denser than each, so the butterfly's re-encoded average
would drop most of it (or, re-sparsified, leave the loss in owners' residuals). And a butterfly's slice
owner averages its slice for everyone, so a malicious one sets that slice to anything; here no member
averages for another. Each member encodes
its whole vector once and sends the same bytes to every groupmate; every member decodes all K byte
strings in group order and reduces them by the run's rule (``swarm.core.all_gather.gather_reference``
is the same computation in one process). Each member sends (K − 1) × the encoded size; at density d
and K peers that is below the butterfly's 2 (K − 1) / K × the dense size while d × K stays small; a dense
codec costs K / 2 × the butterfly's bytes (2× at K = 4, 4× at K = 8).

Trust: the messages travel as the butterfly's (``Exchange._send``), and a contribution counts for group
position s only when it came from the libp2p id the signed group entry lists for s, so no stranger can
replace or abort a member's part. The reduction runs on whole vectors, so ``[rounds] aggregation``
judges (rejects, clips, trims) every member on its whole vector, and every member reaches the same
verdicts. What it does not bound: a member that sends different bytes to different groupmates makes
their averages differ; their θg hashes then disagree, and the round's commit rule (swarm.core.trust.commit_rule)
decides which hash, if any, commits (without a majority of the group on one hash, none), as for a butterfly
owner that sends different averages.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

import torch

from swarm.core.aggregation import Reduced
from swarm.core.codecs.codec import Codec
from swarm.net.bulk.chunk_stream import SlicePayload
from swarm.net.exchange.rendezvous import Member, group_digest
from swarm.net.exchange.slices.reduction import check_sendable, decode_slice, encode_slice, raw_fp32
from swarm.net.exchange.withdrawal import WITHDRAWN, present, renumbered, withdrawn
from swarm.v1 import exchange_pb2

_PART = 0  # the whole vector: every contribution is message part 0 of PHASE_CONTRIBUTION


async def gather_average(
    exchange: Any,
    key: str,
    group: list[Member],
    me: Member,
    flat: Optional[torch.Tensor],
    codec: Codec,
    weights: list[float],
    pause: Callable[[str], Awaitable[None]],
    *,
    into_delta: bool = False,
) -> tuple[Reduced, int]:
    """Send this member's encoded ``flat`` to every groupmate, wait for all of theirs, and reduce them:
    the reduction and the bytes sent. ``exchange`` is the ``swarm.net.exchange.allreduce.Exchange`` whose
    transport, inbox and sender checks carry the messages; ``pause(phase)`` is its fault-injection hook.
    fp32 goes as ``flat``'s own bytes (no encoded copy); ``into_delta``: the average is written into ``flat``'s
    memory once every send is done (a lossless codec's Δ, which the caller reads no more). ``flat`` None: this member
    withdraws (``swarm.net.exchange.withdrawal``), the average is the others'."""
    position = [m.peer_id for m in group].index(me.peer_id)
    digest = group_digest(group)
    await pause("sending")
    if flat is None:
        payload = own = WITHDRAWN
    elif raw_fp32(codec):
        await asyncio.to_thread(check_sendable, codec, flat, key)
        payload, own = SlicePayload.lazy(codec, flat), SlicePayload.lazy(codec, flat).lossless_view()
    else:
        payload = own = await asyncio.to_thread(encode_slice, codec, flat, key)
    await exchange.inbox.deliver(key, digest, exchange_pb2.PHASE_CONTRIBUTION, _PART, position, own or payload)
    sends = [
        exchange._send(m, key, digest, exchange_pb2.PHASE_CONTRIBUTION, _PART, position, payload)
        for i, m in enumerate(group)
        if i != position
    ]
    sent = sum(await asyncio.gather(*sends))
    contributions = await exchange.inbox.wait_for(
        key,
        [
            (digest, exchange_pb2.PHASE_CONTRIBUTION, _PART, sender, group[sender].dht_peer_id)
            for sender in range(len(group))
        ],
        group,
    )
    await pause("reducing")

    def reduce() -> Reduced:
        decoded = [None if withdrawn(data) else decode_slice(codec, data, me.numel, key) for data in contributions]
        kept = present(key, decoded)
        reduced = exchange.aggregation.reduce(
            [decoded[i] for i in kept], [weights[i] for i in kept], out=flat if into_delta and codec.lossless else None
        )
        return renumbered(reduced, kept)

    return await asyncio.to_thread(reduce), sent
