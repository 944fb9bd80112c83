"""A member's withdrawal from an exchange: it takes part (a butterfly owner still reduces and sends its slices, an
all-gather member still reduces everyone's vectors) but contributes nothing, so the average is the one over the
other members, each with its own weight (``Exchange.average`` with ``delta=None``). Two-level averaging uses it:
the representative of a sub-group whose own exchange failed withdraws that sub-group at level 2, and the other
sub-groups still finish (``swarm.net.exchange.two_level``).

A withdrawal is a fixed message in place of each of the member's contributions, sent to every owner (in an
all-gather, to every member). It counts, like any contribution, only from the libp2p id the signed group entry of
its position lists (``swarm.net.exchange.slices.inbox``), so nobody can withdraw another member; and it can only
take a member's weight out of a reduction, never raise anyone's. An honest withdrawing member sends it for every
slice, so every owner leaves the same member out; a dishonest one that withdraws from some slices only changes
nothing a dishonest member could not already do to its own slices (every member still receives the same bytes of
each slice). A reduction whose members all withdrew fails the exchange.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

import torch

from swarm.core.aggregation import Reduced
from swarm.net.bulk.chunk_stream import Turn, settle
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.rendezvous import Member
from swarm.v1 import exchange_pb2

# in place of a contribution (an honest encoding that were these bytes would only withdraw its own sender)
WITHDRAWN = b"\x00swarm exchange: this member withdraws its contribution\x00"


def withdrawn(data: bytes | memoryview) -> bool:
    """Whether a received contribution is a withdrawal."""
    return len(data) == len(WITHDRAWN) and bytes(data) == WITHDRAWN


def present(key: str, decoded: Sequence[Optional[torch.Tensor]]) -> list[int]:
    """The positions whose contribution is here (not withdrawn); ExchangeFailed when every member withdrew."""
    kept = [i for i, d in enumerate(decoded) if d is not None]
    if not kept:
        raise ExchangeFailed(f"{key}: every member withdrew its contribution; there is nothing to average")
    return kept


def renumbered(reduced: Reduced, kept: list[int]) -> Reduced:
    """A reduction over the members ``kept`` (by their group positions), its verdicts by group position."""
    return Reduced(
        reduced.average,
        {kept[i]: why for i, why in reduced.rejected.items()},
        {kept[i]: why for i, why in reduced.clipped.items()},
    )


async def send_withdrawal(
    exchange: Any,
    key: str,
    group: list[Member],
    digest: str,
    position: int,
    parts: int,
    links: dict[int, asyncio.Lock],
    reserved: dict[tuple[int, int, int], Any],
) -> int:
    """``exchange`` (a ``swarm.net.exchange.allreduce.Exchange``) withdraws this member from every one of the
    ``parts`` slices of a butterfly exchange: the withdrawal to each slice's owner (in ``reserved``'s bulk slot if it
    has one; its own slices into its inbox).
    The bytes sent."""
    k = len(group)

    async def withdraw(part: int) -> int:
        owner = part % k
        if owner == position:
            await exchange.inbox.deliver(key, digest, exchange_pb2.PHASE_CONTRIBUTION, part, position, WITHDRAWN)
            return 0
        return await exchange._send(
            group[owner],
            key,
            digest,
            exchange_pb2.PHASE_CONTRIBUTION,
            part,
            position,
            WITHDRAWN,
            turn=Turn(link=links[owner]),
            reservation=reserved.get((exchange_pb2.PHASE_CONTRIBUTION, part, owner)),
        )

    return sum(await settle(withdraw(part) for part in range(parts)))
