"""An exchange's slices over hivemind's libp2p transport: a slice goes as a stream of ``TensorChunk`` messages
(``swarm.net.bulk.chunk_stream``) to the member's handler, which checks that the chunks belong together and puts the
slice in the inbox if its sender is that member (the libp2p id the secure channel authenticated, never a field
of the message). The same handler takes the bulk channel's claims (``swarm.net.bulk.bulk_slices``). Used for the
members without a reachable bulk channel, and for aborts. Owned by the transport's event loop."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from swarm.net.bulk.bulk_slices import BulkSlices, OnSent
from swarm.net.bulk.chunk_stream import SlicePayload, chunk_messages
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.slices.inbox import SliceInbox
from swarm.net.hivemind_api import P2PContext, PeerID
from swarm.net.link.reachability import is_dial_failure, unreachable_groupmate
from swarm.v1 import exchange_pb2

logger = logging.getLogger("swarm.net.exchange.allreduce")  # the exchange's log

# (key, libp2p id, chunk sizes, their arrival times, when the stream opened)
OnChunksReceived = Callable[[str, str, list[int], list[float], Optional[float]], None]


class Libp2pSlices:
    def __init__(
        self,
        transport: Transport,
        *,
        handler_name: str,
        inbox: SliceInbox,
        on_sent: OnSent,
        on_received: OnChunksReceived,
    ) -> None:
        self.transport, self.handler_name, self.inbox = transport, handler_name, inbox
        self.on_sent, self.on_received = on_sent, on_received
        self.bulk: Optional[BulkSlices] = None  # where claims go, once this peer has a bulk channel

    async def start(self) -> None:
        await self.transport.p2p.add_protobuf_handler(
            self.handler_name, self._on_chunks, exchange_pb2.TensorChunk, stream_input=True
        )

    async def send(self, member: Member, key: str, head: dict, payload: SlicePayload) -> int:
        """Send one slice (``head``: its key, digest, phase, part, sender) as a stream of messages, once more if the
        stream breaks; ExchangeFailed when the member cannot be reached or refuses it. The bytes sent."""
        sent = 0
        for attempt in range(2):
            first_byte, sizes = [], []  # when the stream opened (the first chunk went); each message's size
            try:
                ack = await self.transport.p2p.call_protobuf_handler(
                    PeerID.from_base58(member.dht_peer_id),
                    self.handler_name,
                    chunk_messages(payload, head, first_byte, sizes),
                    exchange_pb2.ChunkAck,
                )
            except ValueError:
                # hivemind's stream sometimes closes without the handler's reply although the data arrived
                # (about once in 30 rounds); a slice really lost shows up as a timeout of the phase that needs
                # it, so the exchange never completes silently partial.
                logger.debug("%s: no acknowledgement from %s; relying on the phase timeout", key, member.peer_id)
                return sent + sum(sizes)
            except Exception as e:
                sent += sum(sizes)
                if attempt == 0:
                    continue  # delivery is idempotent: a repeated slice replaces the same inbox entry
                if is_dial_failure(e):
                    raise ExchangeFailed(
                        unreachable_groupmate(key, member.peer_id, member.maddrs, e), unreachable=True
                    ) from None
                raise ExchangeFailed(f"{key}: could not send to {member.peer_id} ({e!r})") from None
            if not ack.ok:
                raise ExchangeFailed(f"{key}: {member.peer_id} refused a slice: {ack.error}")
            if first_byte:
                self.on_sent(key, member.dht_peer_id, sum(sizes), first_byte[0])
            return sent + sum(sizes)
        raise AssertionError("unreachable")

    async def _on_chunks(self, requests, context: P2PContext) -> exchange_pb2.ChunkAck:
        opened = time.perf_counter()  # the stream is open; its first message is still to come
        chunks: list[exchange_pb2.TensorChunk] = []
        arrivals: list[float] = []
        async for message in requests:
            arrivals.append(time.perf_counter())
            chunks.append(message)
        if not chunks:
            return exchange_pb2.ChunkAck(ok=False, error="empty stream")
        head = chunks[0]
        slot = (head.key, head.group_digest, head.phase, head.part, head.sender)
        if len(chunks) != head.num_chunks or any(
            (c.key, c.group_digest, c.phase, c.part, c.sender, c.chunk) != (*slot, i) for i, c in enumerate(chunks)
        ):
            return exchange_pb2.ChunkAck(ok=False, error="chunks of one slice arrived inconsistent or incomplete")
        remote = context.remote_id.to_base58()
        if head.bulk_claims:  # a claim of bulk slots instead of a slice
            if self.bulk is None:
                return exchange_pb2.ChunkAck(ok=False, error="no bulk channel here; send the slice itself")
            return await self.bulk.on_claim(head, remote)
        payload = b"".join(c.data for c in chunks)
        if not await self.inbox.deliver(
            head.key, head.group_digest, head.phase, head.part, head.sender, payload, sender_id=remote
        ):
            return exchange_pb2.ChunkAck(
                ok=False,
                error=self.inbox.refusal(
                    head.key, remote, (head.group_digest, head.phase, head.part, head.sender, remote)
                ),
            )
        sizes = [c.ByteSize() for c in chunks]  # not free at 1 MiB: once each
        self.on_received(head.key, remote, sizes, arrivals, opened)
        return exchange_pb2.ChunkAck(ok=True)
