"""An exchange's slices over the bulk channel (``swarm.net.bulk.bulk_channel``): the sender claims the slot over
libp2p with a one-time Poly1305 key, a ticket and the most bytes the slice may take, as the exchange starts;
once the slice is encoded it sends the bytes over the member's bulk connection in a frame that names the ticket
and carries the bytes' tag under the key. The receiver takes a claim only from the member that the group lists
for that position, and the bytes only when they carry a valid tag. Any refusal sends the slice over libp2p
instead (``Exchange._send``). Owned by the transport's event loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from swarm.net.bulk.bulk_channel import (
    MAC_KEY_BYTES,
    MAX_CLAIMS_PER_SENDER,
    MIN_BULK_BYTES,
    TICKET_BYTES,
    BulkChannel,
    fresh_claim_secrets,
    parse_bulk_address,
    tag,
)
from swarm.net.bulk.bulk_sender import Address
from swarm.net.bulk.chunk_stream import SlicePayload, Turn
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.slices.inbox import SliceInbox
from swarm.net.hivemind_api import PeerID
from swarm.v1 import exchange_pb2

logger = logging.getLogger("swarm.net.exchange.allreduce")  # the exchange's log

# hivemind's stream sometimes closes without the handler's reply although the message arrived (about once in 30
# calls, see Exchange._send_on_turn): a claim is tried again (a repeated claim replaces the first) before the
# slice goes over libp2p, where it would take longer and count as a drop of the fast path
CLAIM_ATTEMPTS = 2

OnSent = Callable[[str, str, int, float], None]  # (key, libp2p id, bytes, first byte's perf_counter)
OnReceived = Callable[[str, str, list[int], list[float]], None]  # (key, libp2p id, read sizes, their times)


@dataclass
class Reservation:
    """A slot on a member's bulk channel, claimed (or being claimed) for one slice: the frame's secrets, and
    the claim's answer (a task: whether the member took the claim)."""

    address: Address
    mac_key: bytes
    ticket: bytes
    max_bytes: int
    claim_bytes: int  # the claim's size, counted with the slice's bytes as the libp2p path counts its headers
    answer: asyncio.Task

    def tag(self, data: bytes | memoryview) -> bytes:
        """``data``'s tag under this reservation's key (CPU work: off the loop for a large slice)."""
        return tag(self.mac_key, data)


class BulkSlices:
    def __init__(
        self,
        transport: Transport,
        channel: BulkChannel,
        *,
        handler_name: str,
        inbox: SliceInbox,
        on_sent: OnSent,
        on_received: OnReceived,
    ) -> None:
        self.transport, self.channel, self.handler_name, self.inbox = transport, channel, handler_name, inbox
        self.on_sent, self.on_received = on_sent, on_received

    def reserve_all(
        self, member: Member, key: str, digest: str, sender: int, slots: list[tuple[int, int, int]]
    ) -> dict[tuple[int, int], Reservation]:
        """Claim ``slots`` ((phase, part, the most bytes the slice may take)) on ``member``'s bulk channel in one
        message, its round trip started now; by (phase, part), those claimed (a slice so small that a claim and
        a frame cost more than one libp2p message goes over libp2p, as every slot does without a usable address)."""
        address = parse_bulk_address(member.bulk)
        claims = [
            exchange_pb2.BulkClaim(
                phase=phase, part=part, max_bytes=max_bytes, **dict(zip(("mac_key", "ticket"), fresh_claim_secrets()))
            )
            for phase, part, max_bytes in slots
            if max_bytes >= MIN_BULK_BYTES
        ]
        if address is None or not claims:
            return {}
        message = exchange_pb2.TensorChunk(
            key=key, group_digest=digest, sender=sender, chunk=0, num_chunks=1, bulk_claims=claims
        )
        answer = asyncio.ensure_future(self._claim(member, key, message))
        share = -(-message.ByteSize() // len(claims))  # each slice's part of the claim's bytes
        return {
            (c.phase, c.part): Reservation(address, c.mac_key, c.ticket, c.max_bytes, share, answer) for c in claims
        }

    def reserve_butterfly(
        self, key: str, group: list[Member], digest: str, position: int, bounds: list[tuple[int, int]], codec
    ) -> dict[tuple[int, int, int], Reservation]:
        """This peer's slots of a butterfly exchange, claimed before anything is encoded (so the claims' round trips
        overlap the encoding), one claim message per groupmate: by (phase, slice, group position sent to), its
        contribution to the owner of every slice (slice i is position i % K's:
        ``swarm.core.average.butterfly_bounds``) and each averaged slice it owns to every member; a slice with
        no slot goes over libp2p."""
        slots: dict[int, list[tuple[int, int, int]]] = {to: [] for to in range(len(group)) if to != position}
        for part, (start, end) in enumerate(bounds):
            owner, size = part % len(group), codec.encoded_size(end - start)  # the most its encoding takes
            if owner != position:
                slots[owner].append((exchange_pb2.PHASE_CONTRIBUTION, part, size))
            else:
                for to in slots:
                    slots[to].append((exchange_pb2.PHASE_AVERAGED, part, size))
        return {
            (phase, part, to): reservation
            for to, wanted in slots.items()
            for (phase, part), reservation in self.reserve_all(group[to], key, digest, position, wanted).items()
        }

    async def _claim(self, member: Member, key: str, claim: exchange_pb2.TensorChunk) -> bool:
        for attempt in range(CLAIM_ATTEMPTS):
            try:
                ack = await self.transport.p2p.call_protobuf_handler(
                    PeerID.from_base58(member.dht_peer_id), self.handler_name, _one(claim), exchange_pb2.ChunkAck
                )
                return ack.ok
            except Exception as e:  # after the last try, any failure to claim: the libp2p path tries and reports it
                logger.debug("%s: no bulk claim with %s (attempt %d: %r)", key, member.peer_id, attempt + 1, e)
        return False

    async def send(
        self,
        member: Member,
        key: str,
        head: dict,
        payload: SlicePayload,
        reservation: Optional[Reservation],
        frame_tag: Optional[bytes],
        turn: Turn,
        *,
        pace_mbit_s: float = 0.0,
    ) -> Optional[int]:
        """Send the bytes in ``reservation``'s slot (made now when None) once its claim is taken and ``turn``
        comes (``frame_tag``: the bytes' tag under its key, made now when None), which ends once the bytes are
        written (the next frame goes behind them while this one waits for its answer); the bytes sent, or None
        when the slice must go over libp2p (a refusal there is then the libp2p path's to report)."""
        slot = (head["phase"], head["part"])
        reservation = reservation or self.reserve_all(
            member, key, head["group_digest"], head["sender"], [(*slot, payload.size)]
        ).get(slot)
        if reservation is None or payload.size > reservation.max_bytes:
            return None
        data = await payload.whole()
        frame_tag = frame_tag or await asyncio.to_thread(reservation.tag, data)
        if not await asyncio.shield(reservation.answer):  # one claim answers several slots: a cancel is not theirs
            return None
        await turn.wait()
        first_byte = await self.transport.bulk_sender.send(
            reservation.address,
            exchange_pb2.BulkHeader(**head, tag=frame_tag, length=len(data), ticket=reservation.ticket),
            data,
            pace_bytes_per_s=int(pace_mbit_s * 1e6 / 8),
            on_written=turn.done,  # the next frame may follow it
        )
        if first_byte is None:
            return None
        sent = len(data) + reservation.claim_bytes
        self.on_sent(key, member.dht_peer_id, sent, first_byte)
        return sent

    async def on_claim(self, head: exchange_pb2.TensorChunk, remote: str) -> exchange_pb2.ChunkAck:
        """A groupmate's claim of its slots (``bulk_claims``; ``remote``: its libp2p id, authenticated): take each
        slot's bytes from the bulk channel once they carry a valid tag."""
        claims = list(head.bulk_claims)
        if (
            head.data
            or len(claims) > MAX_CLAIMS_PER_SENDER
            or any(len(c.mac_key) != MAC_KEY_BYTES or len(c.ticket) != TICKET_BYTES or c.max_bytes <= 0 for c in claims)
        ):
            return exchange_pb2.ChunkAck(ok=False, error="a malformed bulk claim")
        key = head.key
        slots = [(head.group_digest, c.phase, c.part, head.sender, remote) for c in claims]
        async with self.inbox.cond:
            refused = next((slot for slot in slots if not self.inbox.admitted(key, slot)), None)
            if refused is not None:
                self.inbox.reject(key, remote, head.sender, refused)
                return exchange_pb2.ChunkAck(ok=False, error=self.inbox.refusal(key, remote, refused))
        registered = []  # all or none: a claim refused part way leaves nothing behind
        for slot, claim in zip(slots, claims):
            if not self.channel.claim(
                key,
                (*slot[:4], claim.ticket),
                claim.max_bytes,
                claim.mac_key,
                remote,
                self._deliverer(key, slot, remote),
            ):
                for done in registered:
                    self.channel.unclaim(key, done)
                return exchange_pb2.ChunkAck(ok=False, error="too many bulk claims open here; send the slice itself")
            registered.append((*slot[:4], claim.ticket))
        return exchange_pb2.ChunkAck(ok=True)

    def _deliverer(self, key: str, slot: tuple, remote: str):
        """What the channel calls with a claimed slot's verified bytes: into the inbox, counted as received."""

        async def deliver(payload: memoryview, sizes: list[int], arrivals: list[float]) -> bool:
            if not await self.inbox.deliver(key, *slot[:4], payload, sender_id=remote):
                return False
            self.on_received(key, remote, sizes, arrivals)
            return True

        return deliver


async def _one(message) -> AsyncIterator:
    yield message
