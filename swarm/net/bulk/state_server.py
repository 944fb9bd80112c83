"""A peer's server of its committed global state to the run's other members: each request is checked (the
requester's credential against the run and against the libp2p id of the stream), then answered with a libp2p
chunk of the state's bytes or, when the requester names its bulk channel, one frame sent there over plain TCP.
A holder keeps no copy of the state: it serves the safetensors header made at publish and views of the state's
tensors (``swarm.core.state.EncodedState``). The downloader is ``swarm.net.bulk.state_transfer``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from swarm.core.state import EncodedState, GlobalState
from swarm.core.trust.credential import CredentialError, Member
from swarm.net.bulk.bulk_channel import MAC_KEY_BYTES, MIN_BULK_BYTES, TICKET_BYTES, parse_bulk_address, tag
from swarm.net.bulk.transport import Transport
from swarm.net.hivemind_api import P2PContext
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

MIN_CHUNK_BYTES = 1 << 20  # a holder answers at least min(asked, this) over libp2p (a Swarm before 2 MiB: 1 MiB)
MAX_CHUNK_BYTES = 2 << 20  # and at most this (p2pd's messages are at most 4 MiB)
MAX_BULK_FRAME_BYTES = 64 << 20  # sent per request over the bulk channel at most
BULK_GROUP = "state"  # the group_digest of a state frame's slot (an exchange's is its group's digest)


class StateServer:
    """Serves this peer's newest committed state to the run's other members (``member`` checks them)."""

    def __init__(self, transport: Transport, *, run_id: str, member: Member):
        if member is None:
            raise ValueError(
                "a state server needs this peer's credential (a credential.Member) to tell members from strangers."
            )
        self.transport, self.member = transport, member
        self.handler_name = f"swarm_{run_id}.state"
        self._lock = threading.Lock()
        self._round, self._hash = -1, ""
        self._served: EncodedState | None = None
        transport.run(
            transport.p2p.add_protobuf_handler(self.handler_name, self._on_request, exchange_pb2.StateRequest),
            timeout_s=30,
        )

    def publish(self, state: GlobalState) -> None:
        """Serve ``state`` from now on: its header is made now, its bytes are read from its tensors per request
        (the state is kept, not copied). Once its tensors change in place (the trainer commits the next round
        into them) it is no longer served: requests are refused until the next state is published."""
        served = EncodedState(state)
        with self._lock:
            self._round, self._hash, self._served = state.round_no, state.state_hash, served

    async def _on_request(self, request: exchange_pb2.StateRequest, context: P2PContext) -> exchange_pb2.StateChunk:
        refusal = self._refusal(request, context)
        if refusal:
            return exchange_pb2.StateChunk(error=refusal)
        with self._lock:
            served, round_no, state_hash = self._served, self._round, self._hash
        if served is None or round_no != request.round:
            return exchange_pb2.StateChunk(round=round_no, error=f"this peer holds round {round_no}")
        if not 0 <= request.offset <= served.size or request.length < 0:
            return exchange_pb2.StateChunk(
                round=round_no,
                error=f"offset {request.offset} or length {request.length} is outside the state's {served.size} bytes",
            )
        if request.bulk_address and await self._send_bulk(request, served):
            return exchange_pb2.StateChunk(
                round=round_no, state_hash=state_hash, total_bytes=served.size, offset=request.offset, bulk=True
            )
        data = served.read(request.offset, min(request.length, MAX_CHUNK_BYTES))  # the one copy: protobuf's bytes
        if served.changed():
            return self._moved_on(served)
        return exchange_pb2.StateChunk(
            round=round_no, state_hash=state_hash, total_bytes=served.size, offset=request.offset, data=data
        )

    def _moved_on(self, served: EncodedState) -> exchange_pb2.StateChunk:
        """The answer once the served state's tensors were stepped in place (the trainer committed the next
        round into them): its bytes are no longer this round's, so it is withdrawn until the next publish."""
        with self._lock:
            if self._served is served:
                self._round, self._hash, self._served = -1, "", None
        return exchange_pb2.StateChunk(round=-1, error=f"this peer moved on from round {served.round_no}")

    async def _send_bulk(self, request: exchange_pb2.StateRequest, served: EncodedState) -> bool:
        """Send the bytes asked for as one frame over the requester's bulk channel; True when it took them (else
        the answer carries them over libp2p). Only a member gets here, and only to the address it named: the
        frame is tagged under the one-time key it sent over this authenticated stream."""
        address = parse_bulk_address(request.bulk_address)
        length = min(request.length, MAX_BULK_FRAME_BYTES, served.size - request.offset)
        if (
            address is None
            or length < MIN_BULK_BYTES
            or len(request.bulk_mac_key) != MAC_KEY_BYTES
            or len(request.bulk_ticket) != TICKET_BYTES
            or not request.bulk_key
        ):
            return False
        try:
            await self.transport.open_bulk()  # its sender; the exchange opens it too
            loop = asyncio.get_running_loop()
            # a view of one tensor's bytes, or a copy of the frame's bytes where it spans several; tagged off the loop
            data, frame_tag = await loop.run_in_executor(
                None, _frame, served, request.offset, length, request.bulk_mac_key
            )
            if served.changed():  # bytes of a later state may be in it: its frame would not be taken anyway
                return False
            header = exchange_pb2.BulkHeader(
                key=request.bulk_key,
                group_digest=BULK_GROUP,
                phase=exchange_pb2.PHASE_UNSPECIFIED,
                part=request.bulk_part,
                sender=0,
                ticket=request.bulk_ticket,
                length=length,
                tag=frame_tag,
            )
            return await self.transport.bulk_sender.send(address, header, data) is not None
        except Exception as e:  # the bytes go over libp2p instead
            logger.debug("state frame over the bulk channel failed: %r", e)
            return False

    def _refusal(self, request: exchange_pb2.StateRequest, context: P2PContext) -> str:
        """Why this request gets no bytes ('' when it may have them)."""
        try:
            credential = self.member.check(request.credential, now=time.time())
        except CredentialError as e:
            return f"refused: only members of this run download its state ({e})"
        if credential.dht_peer_id != context.remote_id.to_base58():
            return f"refused: the credential of {credential.peer_id} is for another libp2p id than this stream's"
        return ""


def _frame(served: EncodedState, offset: int, length: int, mac_key: bytes) -> tuple[memoryview | bytes, bytes]:
    data = served.view(offset, length)
    return data, tag(mac_key, data)
