"""How an exchange (``swarm.net.exchange.allreduce.Exchange``) sends one slice and counts what its links carry: over a
groupmate's bulk channel when it announces one (paced as the exchange asks), else, or when that fails, over libp2p."""

from __future__ import annotations

from typing import Optional

from swarm.net.bulk.bulk_slices import BulkSlices, Reservation
from swarm.net.bulk.chunk_stream import SlicePayload, Turn
from swarm.net.bulk.libp2p_slices import Libp2pSlices
from swarm.net.exchange.contributions import uplink_pace
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.slices.inbox import SliceInbox
from swarm.net.link.link_stats import TransferLog
from swarm.v1 import exchange_pb2


class SliceSending:
    """The sending half of ``Exchange``, which sets these fields (the loop's during an exchange)."""

    pace_mbit_s: float
    uplink_mbit_s: float
    inbox: Optional[SliceInbox]
    _bulk_slices: Optional[BulkSlices]
    _libp2p: Optional[Libp2pSlices]
    _received_bytes: dict[str, int]
    _transfers: TransferLog

    async def _send(
        self,
        member: Member,
        key: str,
        digest: str,
        phase: int,
        part: int,
        sender: int,
        payload: SlicePayload | bytes,
        *,
        reservation: Optional[Reservation] = None,
        frame_tag: Optional[bytes] = None,
        turn: Optional[Turn] = None,
    ) -> int:
        """Send one slice: over ``member``'s bulk channel if it has one (``reservation``: the slot claimed for
        it, made now when None; ``frame_tag``: the bytes' tag under its key), else, or if that fails, over
        libp2p; its bytes go on ``turn``. The bytes sent."""
        turn = turn or Turn()
        try:
            return await self._send_on_turn(
                member, key, digest, phase, part, sender, payload, reservation, frame_tag, turn
            )
        finally:
            turn.done()

    def _pace(self, key: str) -> float:
        """Each bulk connection's pace in Mbit/s for ``key``'s exchange (0: unpaced)."""
        if self.pace_mbit_s or not self.uplink_mbit_s or self.inbox is None:
            return self.pace_mbit_s
        return uplink_pace(self.uplink_mbit_s, self.inbox.group_size(key))

    async def _send_on_turn(
        self,
        member: Member,
        key: str,
        digest: str,
        phase: int,
        part: int,
        sender: int,
        payload: SlicePayload | bytes,
        reservation: Optional[Reservation],
        frame_tag: Optional[bytes],
        turn: Turn,
    ) -> int:
        payload = SlicePayload(payload) if isinstance(payload, bytes) else payload
        head = dict(key=key, group_digest=digest, phase=phase, part=part, sender=sender)
        if phase != exchange_pb2.PHASE_ABORT and self._bulk_slices is not None:
            bulk_sent = await self._bulk_slices.send(
                member, key, head, payload, reservation, frame_tag, turn, pace_mbit_s=self._pace(key)
            )
            if bulk_sent is not None:
                return bulk_sent
        await turn.wait()
        return await self._libp2p.send(member, key, head, payload)

    def _sent(self, key: str, libp2p_id: str, size: int, first_byte: float) -> None:
        if self.inbox.averaging(key):  # an exchange in progress, not a late abort
            self._transfers.sent(key, libp2p_id, size, first_byte)

    def _received(
        self, key: str, libp2p_id: str, sizes: list[int], arrivals: list[float], opened: Optional[float] = None
    ) -> None:
        self._received_bytes[key] = self._received_bytes.get(key, 0) + sum(sizes)
        self._transfers.received(key, libp2p_id, sizes, arrivals, opened=opened)
