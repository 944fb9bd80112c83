"""The butterfly of one exchange (``swarm.net.exchange.allreduce.Exchange``): every slice sent to its owner, each
owned slice reduced in the group's order once the group's contributions to it are here and its average sent to
every member, and every owner's averaged slices decoded into the result as they arrive. The phases overlap stripe by
stripe: an owner sends back one stripe's average while the next stripe's contributions still arrive."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

import torch

from swarm.core.aggregation import Reduced
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.net.bulk.bulk_slices import Reservation
from swarm.net.bulk.chunk_stream import Turn, settle
from swarm.net.exchange.contributions import exchange_links, send_contributions
from swarm.net.exchange.exchange_result import ExchangeResult
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.slice_reduction import averaged_into, received_slice, reduce_owned
from swarm.net.exchange.withdrawal import send_withdrawal
from swarm.v1 import exchange_pb2

_NOTHING = torch.empty(0)  # a kept reduction's average: the bytes sent are what counts


async def pause(seconds: Optional[float]) -> None:
    if seconds:
        await asyncio.sleep(seconds)


async def butterfly(
    ex: Any,
    key: str,
    group: list[Member],
    position: int,
    digest: str,
    bounds: list[tuple[int, int]],
    reserved: dict[tuple[int, int, int], Reservation],
    flat: Optional[torch.Tensor],
    codec,
    weights: list[float],
    on_phase: Callable[[str], Optional[float]],
    owner: Optional[OwnerFeedback],
    started: float,
    into_delta: bool,
) -> ExchangeResult:
    """``ex``'s butterfly (an ``Exchange``). Phase 1 sends every slice to its owner (``send_contributions``; ``flat`` None: a withdrawal). Each slice this
    peer owns (one per stripe) is reduced in the group's order once the group's contributions to it are here, and the
    same encoded bytes go to every member, while the later stripes' contributions still arrive: the phases overlap.
    Phase 2 decodes every owner's averaged slices into the result as they arrive: with ``into_delta``, into ``flat``'s
    own memory, each slice once this peer's contribution to it is sent (its own slices are reduced in place)."""
    k, stripes = len(group), len(bounds) // len(group)
    others = [(position + i) % k for i in range(1, k)]
    phases_s: dict[str, float] = {}
    reductions: dict[int, Reduced] = {}
    hook: list[asyncio.Future] = []  # on_phase("reducing"), called once, before the first reduction
    links = exchange_links(others, ex.send_in_turn)
    ex._scratch.keep = 2 * k  # a stripe's K decoded contributions, and the next stripe's

    def passed(point: str) -> None:  # the last time the exchange passes each point
        phases_s[point] = time.perf_counter() - started

    sent_parts = {part: asyncio.Event() for part in range(len(bounds)) if part % k != position}
    average = flat if into_delta else ex._results.take(bounds[-1][1])  # written once, by the reductions and decodes

    async def contributed() -> int:
        sent = await (
            send_withdrawal(ex, key, group, digest, position, len(bounds), links, reserved)
            if flat is None
            else send_contributions(ex, key, group, digest, position, bounds, flat, codec, reserved, links, sent_parts)
        )
        passed("contributed")
        return sent

    async def reduced(stripe: int) -> int:
        part = stripe * k + position
        start, end = bounds[part]
        decoded = await settle(
            received_slice(
                ex.inbox,
                ex._scratch,
                key,
                group,
                codec,
                (digest, exchange_pb2.PHASE_CONTRIBUTION, part, sender),
                end - start,
            )
            for sender in range(k)
        )
        passed("contributions_here")
        if not hook:
            hook.append(asyncio.ensure_future(pause(on_phase("reducing"))))
        await hook[0]
        payload, reduction = await asyncio.to_thread(
            reduce_owned,
            ex.aggregation,
            codec,
            decoded,
            weights,
            key,
            owner=owner,
            bounds=(start, end),
            out=average[start:end],
        )
        reductions[stripe] = Reduced(_NOTHING, reduction.rejected, reduction.clipped)
        del decoded, reduction
        passed("reduced")
        sent = sum(await send_averaged(ex, key, group, digest, part, position, payload, others, links, reserved))
        passed("averaged_sent")
        return sent

    async def collected() -> int:
        await averaged_into(
            ex.inbox, average, key, group, codec, digest, bounds, position, sent_parts if into_delta else None
        )
        passed("all_here")
        return 0

    await pause(on_phase("sending"))
    sent = sum(await settle([contributed(), collected(), *(reduced(stripe) for stripe in range(stripes))]))
    return ex._result(key, group, position, average, sent, [reductions[s] for s in range(stripes)], started, phases_s)


async def send_averaged(
    ex: Any,
    key: str,
    group: list[Member],
    digest: str,
    part: int,
    position: int,
    payload,
    others: list[int],
    links: dict[int, asyncio.Lock],
    reserved: dict[tuple[int, int, int], Reservation],
) -> list[int]:
    """The reduced slice ``part``, the same encoded bytes to every other member: the bytes sent to each."""
    return await settle(
        ex._send(
            group[to],
            key,
            digest,
            exchange_pb2.PHASE_AVERAGED,
            part,
            position,
            payload,
            turn=Turn(link=links[to]),
            reservation=reserved.get((exchange_pb2.PHASE_AVERAGED, part, to)),
        )
        for to in others
    )
