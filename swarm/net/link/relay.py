"""Relaying through the coordinator's libp2p node, for groupmates that cannot dial each other (both behind NAT).

A peer behind NAT reaches its groupmates by dialling them, and libp2p answers over the connections it made; two
such peers can dial neither way. libp2p's own circuit relay does not carry a round here: the bundled p2pd resets a
relayed connection after 128 KiB whatever its relay flags say (measured on the WAN testbed; a slice is megabytes).
So the coordinator's node, which every peer dials at its start and keeps a connection to, forwards the bytes:

- The sender's node tries the groupmate directly; when the dial fails, it opens the same stream (or unary call) to
  the coordinator's ``RELAY`` handler with a header naming the groupmate and the handler, and then talks to it as
  if directly. Groupmates it had to relay to are remembered: their next streams go through the coordinator first.
- The coordinator forwards only between two of the run's live members (their libp2p ids, proven at join), to the
  groupmate's ``RELAYED`` handler, with a header naming the sender as libp2p authenticated it to the coordinator.
- The groupmate accepts a relayed stream only over its connection to the coordinator (whose id it learned at join)
  and hands it to the named handler as a stream from that sender: the exchange's check that a slice comes from the
  libp2p id its group entry lists holds, with the coordinator vouching for the id, as it vouches for every member.

The coordinator carries those peers' bytes (each relayed slice crosses its links twice); direct connections are
always tried first. Relayed handlers are the peer's own stream and unary handlers (the exchange, state downloads,
probes); nothing else is reachable through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading
from typing import Any, Callable, Optional

from swarm.net.hivemind_api import P2P, PeerID, StreamInfo
from swarm.net.link.reachability import is_dial_failure

logger = logging.getLogger(__name__)

RELAY = "swarm.relay"  # on the coordinator: forward this stream to the member the header names
RELAY_UNARY = "swarm.relay.unary"
RELAYED = "swarm.relayed"  # on a peer: a stream the coordinator forwards, from the member the header names
RELAYED_UNARY = "swarm.relayed.unary"
MAX_HEADER_BYTES = 1024
_OK, _REFUSED = b"\x01", b"\x00"
_PIPE_CHUNK = 1 << 16
Allowed = Callable[[str], bool]  # is this libp2p id one of the run's live members?


class RelayRefused(RuntimeError):
    """The coordinator would not, or could not, forward to that groupmate."""


def _frame(header: dict[str, str]) -> bytes:
    data = json.dumps(header, sort_keys=True).encode()
    return struct.pack(">I", len(data)) + data


def _split_frame(data: bytes) -> tuple[dict[str, str], bytes]:
    if len(data) < 4:
        raise ValueError("a relayed call without its header")
    (size,) = struct.unpack(">I", data[:4])
    if size > MAX_HEADER_BYTES or len(data) < 4 + size:
        raise ValueError("a relayed call's header is malformed")
    return _parse_header(data[4 : 4 + size]), data[4 + size :]


async def _read_header(reader: asyncio.StreamReader) -> dict[str, str]:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"a relay header of {size} bytes (at most {MAX_HEADER_BYTES})")
    return _parse_header(await reader.readexactly(size))


def _parse_header(data: bytes) -> dict[str, str]:
    header = json.loads(data.decode())
    if not isinstance(header, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in header.items()):
        raise ValueError("a relay header must be an object of strings")
    return header


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_PIPE_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, asyncio.IncompleteReadError, OSError):
        pass


async def _splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    """Copy both ways until both ends are done, then close both."""
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        for writer in (a[1], b[1]):
            writer.close()


class RelayServer:
    """The coordinator's side: forwards streams and unary calls between two live members of the run."""

    def __init__(self, p2p: P2P, allowed: Allowed) -> None:
        self.p2p, self.allowed = p2p, allowed
        self.streams = self.calls = self.refused = 0

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(RELAY, self._on_stream)
        await self.p2p._client.add_unary_handler(RELAY_UNARY, self._on_unary)

    def _check(self, sender: PeerID, header: dict[str, str]) -> PeerID:
        target, handler = header.get("to", ""), header.get("handler", "")
        if not handler or handler.startswith("swarm.relay"):
            raise RelayRefused("a relayed call must name a handler other than the relay's")
        if not (self.allowed(sender.to_base58()) and self.allowed(target)):
            raise RelayRefused("the coordinator relays only between the run's live members")
        return PeerID.from_base58(target)

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await _read_header(reader)
            target = self._check(info.peer_id, header)
            _, out_reader, out_writer = await self.p2p.call_binary_stream_handler(target, RELAYED)
            out_writer.write(_frame({"from": info.peer_id.to_base58(), "handler": header["handler"]}))
            await out_writer.drain()
        except Exception as e:  # noqa: BLE001  refused or unreachable: the sender hears why, in one line
            self.refused += 1
            logger.info("relay: refused a stream from %s: %s", info.peer_id, e)
            writer.write(_REFUSED + str(e).encode()[:200])
            writer.close()
            return
        self.streams += 1
        writer.write(_OK)
        await writer.drain()
        await _splice((reader, writer), (out_reader, out_writer))

    async def _on_unary(self, request: bytes, sender: PeerID) -> bytes:
        header, data = _split_frame(request)
        try:
            target = self._check(sender, header)
        except RelayRefused:
            self.refused += 1
            raise
        self.calls += 1
        return await self.p2p._client.call_unary_handler(
            target, RELAYED_UNARY, _frame({"from": sender.to_base58(), "handler": header["handler"]}) + data
        )


class RelayClient:
    """A peer's side: its calls fall back to the coordinator's relay when a groupmate cannot be dialled, and it
    serves what the coordinator forwards to it."""

    def __init__(self, p2p: P2P, relay_id: str) -> None:
        self.p2p, self.relay = p2p, PeerID.from_base58(relay_id)
        self.via_relay: set[str] = set()  # groupmates reached through the relay before: try it first
        self.relayed_out = self.relayed_in = 0
        self._direct_stream = p2p.call_binary_stream_handler
        self._direct_unary = p2p._client.call_unary_handler

    async def install(self) -> None:
        await self.p2p.add_binary_stream_handler(RELAYED, self._on_relayed_stream)
        await self.p2p._client.add_unary_handler(RELAYED_UNARY, self._on_relayed_unary)
        self.p2p.call_binary_stream_handler = self.open_stream  # type: ignore[method-assign]
        self.p2p._client.call_unary_handler = self.call_unary  # type: ignore[method-assign]

    async def open_stream(self, peer_id: PeerID, handler: str) -> tuple[StreamInfo, Any, Any]:
        return await self._either(
            peer_id, lambda: self._direct_stream(peer_id, handler), lambda: self._relayed_stream(peer_id, handler)
        )

    async def call_unary(self, peer_id: PeerID, handler: str, data: bytes) -> bytes:
        relayed = lambda: self._direct_unary(  # noqa: E731
            self.relay, RELAY_UNARY, _frame({"to": peer_id.to_base58(), "handler": handler}) + data
        )
        return await self._either(peer_id, lambda: self._direct_unary(peer_id, handler, data), relayed)

    async def _either(self, peer_id: PeerID, direct, relayed):
        target = peer_id.to_base58()
        if peer_id == self.relay:
            return await direct()
        if target in self.via_relay:
            return await relayed()
        try:
            return await direct()
        except Exception as e:
            if not is_dial_failure(e):
                raise
            try:
                result = await relayed()
            except Exception as relay_error:  # the direct failure says what the user must fix
                logger.debug("relay to %s failed too: %r", target, relay_error)
                raise e from None
            logger.info(
                "groupmate %s cannot be dialled (%s); reaching it through the coordinator's relay",
                target,
                str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__,
            )
            self.via_relay.add(target)
            return result

    async def _relayed_stream(self, peer_id: PeerID, handler: str) -> tuple[StreamInfo, Any, Any]:
        info, reader, writer = await self._direct_stream(self.relay, RELAY)
        writer.write(_frame({"to": peer_id.to_base58(), "handler": handler}))
        await writer.drain()
        status = await reader.read(1)
        if status != _OK:
            reason = (await reader.read(200)).decode(errors="replace")
            writer.close()
            raise RelayRefused(f"the coordinator's relay did not reach {peer_id}: {reason or 'closed'}")
        self.relayed_out += 1
        return StreamInfo(peer_id=peer_id, addr=info.addr, proto=handler), reader, writer

    async def _on_relayed_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if info.peer_id != self.relay:  # only the coordinator may say who a stream is from
            writer.close()
            return
        try:
            header = await _read_header(reader)
            handler = self.p2p._client.control.handlers[header["handler"]]
            sender = PeerID.from_base58(header["from"])
        except Exception as e:  # noqa: BLE001
            logger.info("relay: dropped a malformed relayed stream: %s", e)
            writer.close()
            return
        self.relayed_in += 1
        await handler(StreamInfo(peer_id=sender, addr=info.addr, proto=header["handler"]), reader, writer)

    async def _on_relayed_unary(self, request: bytes, remote: PeerID) -> bytes:
        if remote != self.relay:
            raise RelayRefused("relayed calls are taken from the coordinator only")
        header, data = _split_frame(request)
        handler = self.p2p._client.control.unary_handlers[header["handler"]]
        self.relayed_in += 1
        return await handler(data, PeerID.from_base58(header["from"]))


def relay_peer_id(initial_peers: list[str]) -> Optional[str]:
    """The coordinator's libp2p id: its node is the peer's first bootstrap address (``/.../p2p/<id>``)."""
    for address in initial_peers:
        if "/p2p/" in address:
            return address.rsplit("/p2p/", 1)[1].split("/")[0] or None
    return None


async def use_relay(p2p: P2P, initial_peers: list[str]) -> Optional[RelayClient]:
    """Let ``p2p``'s calls fall back to the coordinator's relay, and serve what it forwards."""
    relay_id = relay_peer_id(initial_peers)
    if relay_id is None:
        return None
    client = RelayClient(p2p, relay_id)
    await client.install()
    return client


class RelayNode:
    """The coordinator's relay, on its own connection to the coordinator's libp2p daemon and its own loop."""

    def __init__(self, dht: Any, allowed: Allowed, *, timeout_s: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-relay", daemon=True)
        self._thread.start()
        self.server: Optional[RelayServer] = None

        async def start() -> RelayServer:
            server = RelayServer(await dht.replicate_p2p(), allowed)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=timeout_s)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
