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
from swarm.net.exchange.slices.reduction import averaged_into, received_slice, reduce_owned
from swarm.net.exchange.withdrawal import send_withdrawal
from swarm.v1 import exchange_pb2

_NOTHING = torch.empty(0)  # a kept reduction's average: the bytes sent are what counts


async def pause(seconds: Optional[float]) -> None:
    if seconds:
        await asyncio.sleep(seconds)


class Butterfly:
    """``ex``'s butterfly (an ``Exchange``) of one exchange. Phase 1 sends every slice to its owner
    (``send_contributions``; ``flat`` None: a withdrawal). Each slice this peer owns (one per stripe) is reduced in the
    group's order once the group's contributions to it are here, and the same encoded bytes go to every member, while
    the later stripes' contributions still arrive: the phases overlap. Phase 2 decodes every owner's averaged slices
    into the result as they arrive: with ``into_delta``, into ``flat``'s own memory, each slice once this peer's
    contribution to it is sent (its own slices are reduced in place)."""

    def __init__(
        self,
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
    ) -> None:
        self.ex, self.key, self.group, self.position, self.digest = ex, key, group, position, digest
        self.bounds, self.reserved, self.flat, self.codec, self.weights = bounds, reserved, flat, codec, weights
        self.on_phase, self.owner, self.started, self.into_delta = on_phase, owner, started, into_delta
        self.k, self.stripes = len(group), len(bounds) // len(group)
        self.others = [(position + i) % self.k for i in range(1, self.k)]
        self.phases_s: dict[str, float] = {}
        self.reductions: dict[int, Reduced] = {}
        self.hook: list[asyncio.Future] = []  # on_phase("reducing"), called once, before the first reduction
        self.links = exchange_links(self.others, ex.send_in_turn)
        ex._scratch.keep = 2 * self.k  # a stripe's K decoded contributions, and the next stripe's
        self.sent_parts = {part: asyncio.Event() for part in range(len(bounds)) if part % self.k != position}
        # written once, by the reductions and decodes
        self.average = flat if into_delta else ex._results.take(bounds[-1][1])

    async def run(self) -> ExchangeResult:
        await pause(self.on_phase("sending"))
        parts = [self._contributed(), self._collected(), *(self._reduced(stripe) for stripe in range(self.stripes))]
        sent = sum(await settle(parts))
        reductions = [self.reductions[s] for s in range(self.stripes)]
        return self.ex._result(
            self.key, self.group, self.position, self.average, sent, reductions, self.started, self.phases_s
        )

    def _passed(self, point: str) -> None:  # the last time the exchange passes each point
        self.phases_s[point] = time.perf_counter() - self.started

    async def _contributed(self) -> int:
        ex, key, group, digest, position, bounds = (
            self.ex,
            self.key,
            self.group,
            self.digest,
            self.position,
            self.bounds,
        )
        sent = await (
            send_withdrawal(ex, key, group, digest, position, len(bounds), self.links, self.reserved)
            if self.flat is None
            else send_contributions(
                ex,
                key,
                group,
                digest,
                position,
                bounds,
                self.flat,
                self.codec,
                self.reserved,
                self.links,
                self.sent_parts,
            )
        )
        self._passed("contributed")
        return sent

    async def _reduced(self, stripe: int) -> int:
        ex, key, group, codec = self.ex, self.key, self.group, self.codec
        part = stripe * self.k + self.position
        start, end = self.bounds[part]
        decoded = await settle(
            received_slice(
                ex.inbox,
                ex._scratch,
                key,
                group,
                codec,
                (self.digest, exchange_pb2.PHASE_CONTRIBUTION, part, sender),
                end - start,
            )
            for sender in range(self.k)
        )
        self._passed("contributions_here")
        if not self.hook:
            self.hook.append(asyncio.ensure_future(pause(self.on_phase("reducing"))))
        await self.hook[0]
        payload, reduction = await asyncio.to_thread(
            reduce_owned,
            ex.aggregation,
            codec,
            decoded,
            self.weights,
            key,
            owner=self.owner,
            bounds=(start, end),
            out=self.average[start:end],
        )
        self.reductions[stripe] = Reduced(_NOTHING, reduction.rejected, reduction.clipped)
        del decoded, reduction
        self._passed("reduced")
        sent = await send_averaged(
            ex, key, group, self.digest, part, self.position, payload, self.others, self.links, self.reserved
        )
        self._passed("averaged_sent")
        return sum(sent)

    async def _collected(self) -> int:
        await averaged_into(
            self.ex.inbox,
            self.average,
            self.key,
            self.group,
            self.codec,
            self.digest,
            self.bounds,
            self.position,
            self.sent_parts if self.into_delta else None,
        )
        self._passed("all_here")
        return 0


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
