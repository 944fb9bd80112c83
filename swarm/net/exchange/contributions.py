"""Phase 1 of the butterfly all-reduce (``swarm.net.exchange.allreduce``): a member's slices to their owners, stripe by
stripe, each encoded (and tagged for its bulk slot) in turn and sent the moment it is ready and its groupmate's link
is free, its own slice of each stripe put straight into its inbox."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Optional

import torch

from swarm.core.codecs.error_feedback import DroppedInPlace
from swarm.net.bulk.bulk_slices import Reservation
from swarm.net.bulk.chunk_stream import SlicePayload, Turn, settle
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.slices.reduction import check_sendable, encode_slice
from swarm.v1 import exchange_pb2


async def send_contributions(
    exchange: Any,
    key: str,
    group: list[Member],
    digest: str,
    position: int,
    bounds: list[tuple[int, int]],
    flat: torch.Tensor,
    codec,
    reserved: dict[tuple[int, int, int], Reservation],
    links: dict[int, asyncio.Lock],
    sent: Optional[dict[int, asyncio.Event]] = None,
) -> int:
    """``exchange`` (a ``swarm.net.exchange.allreduce.Exchange``) sends every slice to its owner, stripe by stripe, owners
    from the next position on. The slices are encoded (and tagged for their bulk slot) one after another in that
    order, each stripe's own slice last, each sent as soon as it is ready and its link (one of ``links``) is free:
    encoding them all at once would delay the first send by the whole vector's encoding. ``sent``: by slice, an
    event set once that slice went to its owner (nothing reads its values after: the result may take their memory).
    The bytes sent."""
    await asyncio.to_thread(check_sendable, codec, flat, key)
    k, stripes = len(group), len(bounds) // len(group)
    others = [(position + i) % k for i in range(1, k)]
    order = [(stripe, to) for stripe in range(stripes) for to in [*others, position]]
    encoding = Turn.chain(len(order))  # the i-th slice's encoding, after the one before it

    def own(i: int) -> Awaitable[int]:
        part = order[i][0] * k + position
        return deliver_own(exchange, key, digest, part, position, bounds, codec, flat, encoding[i])

    async def send(i: int) -> int:
        stripe, to = order[i]
        part, turn = stripe * k + to, Turn(link=links[to])
        reservation = reserved.get((exchange_pb2.PHASE_CONTRIBUTION, part, to))
        try:
            payload, frame_tag = await tagged_in_turn(encoding[i], codec, flat, bounds[part], key, reservation)
        except BaseException:
            turn.done()  # the sends after it are called off too; none waits for this one meanwhile
            raise
        size = await exchange._send(
            group[to],
            key,
            digest,
            exchange_pb2.PHASE_CONTRIBUTION,
            part,
            position,
            payload,
            reservation=reservation,
            frame_tag=frame_tag,
            turn=turn,
        )
        if sent is not None and part in sent:
            sent[part].set()
        return size

    # an encoding or a send that fails calls off the rest
    return sum(await settle(own(i) if to == position else send(i) for i, (_, to) in enumerate(order)))


async def tagged_in_turn(
    turn: Turn, codec, flat: torch.Tensor, span: tuple[int, int], key: str, reservation: Optional[Reservation]
) -> tuple[SlicePayload, Optional[bytes]]:
    """The slice ``flat[span]`` encoded in its ``turn`` (after the slice before it), and its tag for ``reservation``
    (its bulk slot, if any)."""
    start, end = span
    await turn.wait()
    try:
        return await tagged_slice(codec, flat, start, end, key, reservation)
    finally:
        turn.done()


async def deliver_own(
    exchange: Any,
    key: str,
    digest: str,
    part: int,
    position: int,
    bounds: list[tuple[int, int]],
    codec,
    flat: torch.Tensor,
    turn: Turn,
) -> int:
    """This member's own slice ``part`` of ``flat``, encoded in its ``turn``, put straight into its inbox (0 bytes
    sent)."""
    start, end = bounds[part]
    await turn.wait()
    try:
        data = await own_slice_bytes(codec, flat, start, end, key)
    finally:
        turn.done()
    await exchange.inbox.deliver(key, digest, exchange_pb2.PHASE_CONTRIBUTION, part, position, data)
    return 0


async def tagged_slice(
    codec, flat: torch.Tensor, start: int, end: int, key: str, reservation: Optional[Reservation]
) -> tuple[SlicePayload, Optional[bytes]]:
    """The slice ``flat[start:end]`` to send, and its tag for ``reservation`` (its bulk slot, if any)."""
    payload = SlicePayload.lazy(codec, flat[start:end])
    if payload is None:  # off the event loop, which keeps serving the other peers' streams
        payload = SlicePayload(await asyncio.to_thread(encode_own, codec, flat, start, end, key))
    if reservation is None:
        return payload, None
    return payload, await asyncio.to_thread(reservation.tag, await payload.whole())


async def own_slice_bytes(codec, flat: torch.Tensor, start: int, end: int, key: str):
    """This peer's own slice ``flat[start:end]`` as the reduction reads it."""
    own_slice = SlicePayload.lazy(codec, flat[start:end])
    if own_slice is not None and own_slice.lossless_view() is not None:
        return own_slice.lossless_view()  # fp32: its bytes are the vector's; the reduction reads them there
    return await asyncio.to_thread(encode_own, codec, flat, start, end, key)


def encode_own(codec, flat: torch.Tensor, start: int, end: int, key: str) -> bytes:
    """``flat[start:end]``'s bytes; error feedback's residual of the slice is left in its place (``DroppedInPlace``:
    the values are not read again)."""
    data = encode_slice(codec, flat[start:end].contiguous(), key)
    DroppedInPlace.encoded(flat, start, end, data, codec)
    return data


def exchange_links(others: list[int], send_in_turn: bool) -> dict[int, asyncio.Lock]:
    """One exchange's links by group position sent to: the sends to one groupmate (both phases, every stripe)
    take turns on one connection, in the order their bytes are ready, so the K − 1 flows of a member's
    uplink stay K − 1 (which ``uplink_pace`` assumes) and a stripe its owner waits for is not slowed by a
    later one; with ``send_in_turn`` all sends take turns on one link."""
    if send_in_turn:
        link = asyncio.Lock()
        return {to: link for to in others}
    return {to: asyncio.Lock() for to in others}


def uplink_pace(uplink_mbit_s: float, group_size: int) -> float:
    """The pace of each of a K-member exchange's K − 1 concurrent bulk connections that keeps them together just
    under the declared uplink (0: unpaced when there is nobody to send to)."""
    return 0.95 * uplink_mbit_s / (group_size - 1) if uplink_mbit_s > 0 and group_size > 1 else 0.0
