"""The last step of two-level averaging (``swarm.net.exchange.two_level``): a sub-group's representative hands the
cross-site average to the other members of its sub-group, the same raw fp32 bytes to each, so every member
applies exactly the representative's average.

A member takes it only for a key it expects (it says so before its sub-group starts averaging, so the
representative cannot be earlier), only from the libp2p id of its sub-group's representative (the id
libp2p's secure channel authenticated, never a field of the message), only with the plan digest it
derived, and only of the expected size and finite. A representative that gives up says so (an abort), so
its members fail at once instead of waiting out their timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch

from swarm.net.bulk.transport import CHUNK_BYTES, Transport
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.rendezvous import Member
from swarm.net.hivemind_api import P2PContext, PeerID, as_aiter
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

MAX_REASON_BYTES = 1000
SEND_ATTEMPTS = 2


class SiteBroadcast:
    """Owned by the thread that runs the exchanges; the dicts below belong to the transport's event loop."""

    def __init__(self, transport: Transport, *, run_id: str) -> None:
        self.transport = transport
        self._handler_name = f"swarm_{run_id}.site_average"
        self._expected: dict[str, tuple[str, str, int]] = {}  # key -> (plan digest, representative's libp2p id, numel)
        self._arrived: dict[str, tuple[int, bytes]] = {}  # key -> (phase, payload)
        self._cond: Optional[asyncio.Condition] = None
        self.rejected_messages = 0  # from a sender that is not the expected representative, or unexpected
        transport.run(self._start(), timeout_s=30)

    async def _start(self) -> None:
        self._cond = asyncio.Condition()
        await self.transport.p2p.add_protobuf_handler(
            self._handler_name, self._on_chunks, exchange_pb2.TensorChunk, stream_input=True
        )

    def expect(self, key: str, *, digest: str, representative: Member, numel: int) -> None:
        """From now on accept the average for ``key`` from ``representative`` (until ``receive`` or ``forget``)."""

        async def expect() -> None:
            async with self._cond:
                self._expected[key] = (digest, representative.dht_peer_id, numel)
                self._arrived.pop(key, None)

        self.transport.run(expect(), timeout_s=5)

    def receive(self, key: str, *, timeout_s: float) -> torch.Tensor:
        """The representative's average for ``key``; ExchangeFailed when it aborts or does not come in time."""

        async def wait() -> tuple[int, bytes]:
            async with self._cond:
                await asyncio.wait_for(self._cond.wait_for(lambda: key in self._arrived), timeout_s)
                return self._arrived[key]

        try:
            phase, payload = self.transport.run(wait(), timeout_s=timeout_s + 5)
        except (asyncio.TimeoutError, TimeoutError):
            raise ExchangeFailed(f"{key}: the site's representative sent no average within {timeout_s:.0f}s") from None
        finally:
            self.forget(key)
        if phase == exchange_pb2.PHASE_ABORT:
            raise ExchangeFailed(
                f"{key}: the site's representative gave up ({payload.decode(errors='replace')})", from_groupmate=True
            )
        average = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        if not torch.isfinite(average).all():
            raise ExchangeFailed(f"{key}: the site's representative sent non-finite values")
        return average

    def forget(self, key: str) -> None:
        async def forget() -> None:
            async with self._cond:
                self._expected.pop(key, None)
                self._arrived.pop(key, None)

        self.transport.run(forget(), timeout_s=5)

    def send(self, key: str, *, digest: str, members: list[Member], average: torch.Tensor, timeout_s: float) -> int:
        """Send ``average`` to ``members`` at once; the bytes acknowledged. Best effort: a member that misses
        it fails its own exchange, the representative's result stands."""
        payload = average.detach().to(torch.float32).contiguous().numpy().tobytes()
        return self._to_all(key, digest, members, exchange_pb2.PHASE_AVERAGED, payload, timeout_s)

    def abort(self, key: str, *, digest: str, members: list[Member], reason: str, timeout_s: float = 2.0) -> None:
        """Tell ``members`` that this representative has no average for them (best effort)."""
        self._to_all(key, digest, members, exchange_pb2.PHASE_ABORT, reason.encode()[:MAX_REASON_BYTES], timeout_s)

    def _to_all(
        self, key: str, digest: str, members: list[Member], phase: int, payload: bytes, timeout_s: float
    ) -> int:
        async def all_sends() -> list[int]:
            return await asyncio.gather(*(self._send(m, key, digest, phase, payload) for m in members))

        try:
            return sum(self.transport.run(asyncio.wait_for(all_sends(), timeout_s), timeout_s=timeout_s + 5))
        except (asyncio.TimeoutError, TimeoutError):
            logger.warning("%s: the site's average did not reach every member within %.0fs", key, timeout_s)
            return 0

    async def _send(self, member: Member, key: str, digest: str, phase: int, payload: bytes) -> int:
        num_chunks = max(1, -(-len(payload) // CHUNK_BYTES))
        messages = [
            exchange_pb2.TensorChunk(
                key=key,
                group_digest=digest,
                phase=phase,
                chunk=i,
                num_chunks=num_chunks,
                data=payload[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES],
            )
            for i in range(num_chunks)
        ]
        for attempt in range(SEND_ATTEMPTS):
            try:
                ack = await self.transport.p2p.call_protobuf_handler(
                    PeerID.from_base58(member.dht_peer_id),
                    self._handler_name,
                    as_aiter(*messages),
                    exchange_pb2.ChunkAck,
                )
            except Exception as e:  # noqa: BLE001 - logged; the member's own exchange fails without it
                if attempt + 1 < SEND_ATTEMPTS:
                    continue
                logger.warning("%s: could not hand the site's average to %s (%r)", key, member.peer_id, e)
                return 0
            if not ack.ok:
                logger.warning("%s: %s refused the site's average: %s", key, member.peer_id, ack.error)
                return 0
            return sum(m.ByteSize() for m in messages)
        return 0

    async def _on_chunks(self, requests, context: P2PContext) -> exchange_pb2.ChunkAck:
        remote = context.remote_id.to_base58()
        chunks: list[exchange_pb2.TensorChunk] = []
        size, numel = 0, 0
        async for message in requests:
            if not chunks:
                why = self._refusal(message, remote)
                if why:
                    self.rejected_messages += 1
                    logger.warning("%s: refused a site average from %s: %s", message.key[:100], remote, why)
                    return exchange_pb2.ChunkAck(ok=False, error=why)
                numel = self._expected[message.key][2]
            chunks.append(message)
            size += len(message.data)
            if size > 4 * numel + MAX_REASON_BYTES:
                return exchange_pb2.ChunkAck(ok=False, error="more bytes than the average holds")
        if not chunks:
            return exchange_pb2.ChunkAck(ok=False, error="empty stream")
        head = chunks[0]
        if len(chunks) != head.num_chunks or any(
            (c.key, c.group_digest, c.phase, c.chunk) != (head.key, head.group_digest, head.phase, i)
            for i, c in enumerate(chunks)
        ):
            return exchange_pb2.ChunkAck(ok=False, error="chunks arrived inconsistent or incomplete")
        payload = b"".join(c.data for c in chunks)
        if head.phase == exchange_pb2.PHASE_AVERAGED and len(payload) != 4 * numel:
            return exchange_pb2.ChunkAck(ok=False, error=f"an average of {len(payload)} bytes, not {4 * numel}")
        async with self._cond:
            if head.key in self._expected:  # not forgotten while the stream came in
                self._arrived[head.key] = (head.phase, payload)
                self._cond.notify_all()
        return exchange_pb2.ChunkAck(ok=True)

    def _refusal(self, head: exchange_pb2.TensorChunk, remote: str) -> str:
        """Why the stream ``head`` opens is not for this peer; "" when it is."""
        expected = self._expected.get(head.key)
        if expected is None:
            return "this peer expects no site average under that key"
        digest, representative, _ = expected
        if remote != representative:
            return "the sender is not this peer's site representative"
        if head.group_digest != digest:
            return "the sender derived another two-level plan"
        if head.phase not in (exchange_pb2.PHASE_AVERAGED, exchange_pb2.PHASE_ABORT):
            return "not an average or an abort"
        return ""
