"""The coordinator's relay (swarm.net.link.relay) with real libp2p daemons on loopback: a stream and a unary call reach a
groupmate through it as coming from their sender; a non-member is refused; only the coordinator may relay.
(Loopback dials never fail, so the sender is told to go through the relay first; the fall-back on a failed dial is
shown across NAT hosts in tests/integration/test_nat.py.)"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, P2PContext

from swarm.net.link.relay import RELAYED, RelayClient, RelayServer, _frame
from swarm.v1 import exchange_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


async def _node(relay: P2P | None = None) -> P2P:
    initial = [str(a) for a in await relay.get_visible_maddrs()] if relay else None
    return await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


async def _scenario() -> dict:
    relay = await _node()
    a, b, stranger = await _node(relay), await _node(relay), await _node(relay)
    members = {a.peer_id.to_base58(), b.peer_id.to_base58()}
    server = RelayServer(relay, allowed=lambda peer: peer in members)
    await server.start()
    clients = {}
    for node in (a, b, stranger):
        clients[node] = RelayClient(node, relay.peer_id.to_base58())
        await clients[node].install()
    seen: list[tuple[str, int]] = []

    async def collect(requests, context: P2PContext) -> exchange_pb2.ChunkAck:
        size = 0
        async for chunk in requests:
            size += len(chunk.data)
        seen.append((context.remote_id.to_base58(), size))
        return exchange_pb2.ChunkAck(ok=True, error=str(size))

    async def ping(request: exchange_pb2.ChunkAck, context: P2PContext) -> exchange_pb2.ChunkAck:
        return exchange_pb2.ChunkAck(ok=True, error=context.remote_id.to_base58())

    await b.add_protobuf_handler("collect", collect, exchange_pb2.TensorChunk, stream_input=True)
    await b.add_protobuf_handler("ping", ping, exchange_pb2.ChunkAck)

    async def chunks(count: int):
        for i in range(count):
            yield exchange_pb2.TensorChunk(chunk=i, data=b"x" * 65536)

    out: dict = {}
    clients[a].via_relay.add(b.peer_id.to_base58())  # as after a failed dial: through the relay
    ack = await a.call_protobuf_handler(b.peer_id, "collect", chunks(40), exchange_pb2.ChunkAck)
    out["stream"] = (ack.error, list(seen))
    out["unary"] = (
        await a.call_protobuf_handler(b.peer_id, "ping", exchange_pb2.ChunkAck(), exchange_pb2.ChunkAck)
    ).error
    out["counts"] = (server.streams, server.calls, clients[a].relayed_out, clients[b].relayed_in)

    clients[stranger].via_relay.add(b.peer_id.to_base58())  # not a member: the relay refuses
    try:
        await stranger.call_protobuf_handler(b.peer_id, "collect", chunks(1), exchange_pb2.ChunkAck)
        out["stranger"] = "delivered"
    except Exception as e:  # noqa: BLE001
        out["stranger"] = str(e)
    # a stranger's own "relayed" stream, claiming to come from a: b drops it without calling the handler
    _, reader, writer = await clients[stranger]._direct_stream(b.peer_id, RELAYED)
    writer.write(_frame({"from": a.peer_id.to_base58(), "handler": "collect"}))
    await writer.drain()
    out["forged"] = await asyncio.wait_for(reader.read(), 10)
    out["seen_after"] = list(seen)
    for node in (a, b, stranger, relay):
        await node.shutdown()
    return out


def test_the_relay_forwards_between_members_as_the_sender_and_refuses_anyone_else():
    out = asyncio.run(_scenario())
    a_id = out["stream"][1][0][0]
    assert out["stream"] == ("2621440", [(a_id, 40 * 65536)])  # 2.5 MiB: far past libp2p's relayed-connection cap
    assert out["unary"] == a_id  # b's handler saw the sender, not the coordinator
    assert out["counts"] == (1, 1, 1, 2)
    assert "delivered" != out["stranger"]
    assert out["forged"] == b"" and out["seen_after"] == out["stream"][1]  # closed unheard
