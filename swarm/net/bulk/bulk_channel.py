"""The receiving side of the bulk channel: a plain TCP listener beside the libp2p node that takes an
exchange's slice bytes straight from the socket into one buffer, without p2pd's relay, TLS and yamux.

Why it is safe although the channel is not authenticated: bytes are read only for a slot that the sender
claimed first over libp2p (``Exchange`` checks there that the claim comes from the libp2p id of that group
position) with a one-time key, a ticket and the most bytes the slice may take. The frame names the ticket and
carries the bytes' Poly1305 tag under the key. libp2p's secure channel keeps key and ticket between the two
ends, so no one else can name the slot or make other bytes with a valid tag (a forgery succeeds with
probability below 2^-80 for any slice size here); the sender uses each key for one frame only, as a one-time
authenticator needs. Poly1305 rather than a SHA-256 digest: it is 3-4x cheaper per byte, and with a fresh key
per claim it is as binding for everyone but the sender, who may send any bytes for its own slot anyway. Since
the claim needs neither the bytes nor their tag, a sender claims its slots as the exchange starts, and the
claim's round trip (tens of ms through p2pd on a busy host, one RTT on a WAN link) is not paid between the
encoding and the first byte. A frame whose header names no such claim, or more bytes than it, is refused before
a byte of its body is read; a body whose tag differs is dropped and counted; one connection at a time reads for
a claim, and the bytes being read but not yet verified stay under ``max_pending_bytes``. A refused sender sends
the slice over libp2p instead, so an attacker who knows the port can slow an exchange down to today's path,
never change or fail it.

Frame: ``MAGIC``, a little-endian u32 header length, an ``exchange_pb2.BulkHeader``, ``length`` bytes;
the receiver answers one status byte (``OK`` or why not) and the connection carries the next frame.
Everything here runs on the transport's event loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

from swarm.core.average import MAX_STRIPES
from swarm.net.link.p2p_address import is_wildcard
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

MAGIC = b"SWB1"
PREFIX = struct.Struct("<4sI")  # MAGIC, header length
MAX_HEADER_BYTES = 4096
BACK_TO_BACK_S = 0.02  # a frame's header read this soon after reading resumed was waiting in the socket (or
# nearly: a sender's gap this short counts as busy, an underestimate of at most this per frame)
MAX_PENDING_BYTES = 1 << 30  # bulk bytes read but not yet verified, all connections together
MAX_CLAIMS = 4096  # slots announced and not yet delivered, all keys together
# per key: an honest member claims 2 per stripe (a contribution, an averaged slice), and may resend
MAX_CLAIMS_PER_SENDER = 2 * MAX_STRIPES + 6
MIN_BULK_BYTES = 1 << 16  # smaller slices go over libp2p: one message there costs less than a claim and a frame

# The status byte after a frame. Anything but OK: the sender sends the slice over libp2p instead.
OK, NO_CLAIM, BUSY, OVER_CAP, MISMATCH, BAD_FRAME, UNDELIVERED = range(7)
STATUS_WORDS = {
    NO_CLAIM: "no claim for that slot",
    BUSY: "another connection is reading that slot",
    OVER_CAP: "too many unverified bulk bytes held",
    MISMATCH: "bytes differ from the claimed tag",
    BAD_FRAME: "malformed frame",
    UNDELIVERED: "the exchange refused the slice",
}

Slot = tuple[str, int, int, int, bytes]  # (group digest, phase, part, sender position, ticket)
MAC_KEY_BYTES, TAG_BYTES, TICKET_BYTES = 32, 16, 16
Deliver = Callable[[memoryview, list[int], list[float]], Awaitable[bool]]


@dataclass
class Claim:
    """A slot announced over libp2p by its (authenticated) sender: ``deliver`` hands verified bytes on."""

    deliver: Deliver  # (payload, read sizes, their arrival times) -> whether the exchange took it
    mac_key: bytes
    max_bytes: int  # the most the slice may take (its codec's size bound)
    sender_id: str  # the libp2p id that claimed it (authenticated by libp2p)
    reading: bool = False  # a connection is reading bytes for it now


@dataclass
class Drops:
    """Frames refused, by reason (``STATUS_WORDS``), since the channel started."""

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, status: int) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1
        total = sum(self.counts.values())
        if total & (total - 1) == 0:  # the 1st, 2nd, 4th...: never a flood
            logger.warning("bulk channel refused a frame: %s (%d refused so far)", STATUS_WORDS[status], total)


def fresh_claim_secrets() -> tuple[bytes, bytes]:
    """A claim's one-time key and ticket, fresh from the OS's generator."""
    return os.urandom(MAC_KEY_BYTES), os.urandom(TICKET_BYTES)


def tag(mac_key: bytes, data: bytes | memoryview) -> bytes:
    """``data``'s Poly1305 tag under a claim's one-time key: what its frame carries."""
    return Poly1305.generate_tag(mac_key, data)


def bulk_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_bulk_address(text: str) -> Optional[tuple[str, int]]:
    """(host, port) of a member's ``bulk`` field, or None when it is empty or not an address to dial."""
    if not text or len(text) > 300 or not text.isprintable() or " " in text:
        return None
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or is_wildcard(host):
        return None
    if not all(c.isalnum() or c in ".-:" for c in host):
        return None
    return host, int(port)


class BulkChannel:
    """One per transport, shared by its exchanges; claims by key, each key's registered by its exchange."""

    def __init__(self, *, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.drops = Drops()
        self.frames_taken = 0  # frames whose bytes matched their claim and were delivered
        self.address = ""  # what groupmates dial ("" until started, or when no address can be announced)
        self._claims: dict[str, dict[Slot, Claim]] = {}
        self._readers: set[_Reader] = set()
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self, listen_host: str, announce_host: Optional[str]) -> None:
        """Listen on ``listen_host`` (port 0); announce ``announce_host`` (else the listen address when it
        is one address; else nothing, and groupmates send over libp2p)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Reader(self),
            host=listen_host,
            port=0,
            family=socket.AF_INET6 if ":" in listen_host else socket.AF_INET,
        )
        port = self._server.sockets[0].getsockname()[1]
        host = announce_host or (None if is_wildcard(listen_host) else listen_host)
        self.address = bulk_address(host, port) if host else ""

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for reader in list(self._readers):
            reader.abort()

    def claim(self, key: str, slot: Slot, max_bytes: int, mac_key: bytes, sender_id: str, deliver: Deliver) -> bool:
        """Expect at most ``max_bytes`` of ``slot``'s bytes for ``key`` from ``sender_id``; False when it or
        everyone has too many claims open (the sender then sends over libp2p). A repeated claim replaces the
        earlier (a resend)."""
        claims = self._claims.setdefault(key, {})
        if slot not in claims and (
            sum(map(len, self._claims.values())) >= MAX_CLAIMS
            or sum(c.sender_id == sender_id for c in claims.values()) >= MAX_CLAIMS_PER_SENDER
        ):
            return False
        claims[slot] = Claim(deliver, mac_key, max_bytes, sender_id)
        return True

    def unclaim(self, key: str, slot: Slot) -> None:
        """Drop a claim no frame is being read for (a claim of several slots that could not be registered whole)."""
        claims = self._claims.get(key, {})
        if slot in claims and not claims[slot].reading:
            del claims[slot]

    def forget(self, key: str) -> None:
        """Drop ``key``'s claims and stop reading bytes for them (its exchange is over)."""
        self._claims.pop(key, None)
        for reader in [r for r in self._readers if r.key == key]:
            reader.abort()

    def _take(self, header: exchange_pb2.BulkHeader) -> tuple[int, Optional[Claim]]:
        claim = self._claims.get(header.key, {}).get(_slot(header))
        if claim is None:
            return NO_CLAIM, None
        if header.length > claim.max_bytes:
            return BAD_FRAME, None
        if claim.reading:
            return BUSY, None
        if self.pending_bytes + header.length > self.max_pending_bytes:
            return OVER_CAP, None
        claim.reading = True
        self.pending_bytes += header.length
        return OK, claim

    def _release(self, header: exchange_pb2.BulkHeader, claim: Claim, *, delivered: bool) -> None:
        self.pending_bytes -= header.length
        claim.reading = False
        if delivered:
            self._claims.get(header.key, {}).pop(_slot(header), None)


def _slot(header: exchange_pb2.BulkHeader) -> Slot:
    return header.group_digest, header.phase, header.part, header.sender, header.ticket


class _Reader(asyncio.BufferedProtocol):
    """One inbound connection: frames read in turn, each body straight into its own buffer."""

    def __init__(self, channel: BulkChannel) -> None:
        self.channel = channel
        self.transport: Optional[asyncio.Transport] = None
        self.key: Optional[str] = None  # the key of the claim being read
        # a frame that follows the one before it back to back (the sender does not wait for answers) came partly
        # while that one was being taken (reading paused): it is timed from the previous body's last byte
        self._last_byte = self._resumed = 0.0
        self._reset()

    def _reset(self) -> None:
        self._buffer = bytearray(PREFIX.size)
        self._got = 0
        self._stage = "prefix"
        self._header: Optional[exchange_pb2.BulkHeader] = None
        self._claim: Optional[Claim] = None
        self._mac: Optional[Poly1305] = None
        self._sizes: list[int] = []
        self._arrivals: list[float] = []
        self.key = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.channel._readers.add(self)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.channel._readers.discard(self)
        self._drop_claim()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._got :]  # the body's bytes go straight where they stay

    def buffer_updated(self, nbytes: int) -> None:
        if self._stage == "body":
            self._mac.update(self._buffer[self._got : self._got + nbytes])
            self._sizes.append(nbytes)
            self._arrivals.append(time.perf_counter())
        self._got += nbytes
        if self._got < len(self._buffer):
            return
        if self._stage == "prefix":
            magic, size = PREFIX.unpack(self._buffer)
            if magic != MAGIC or not 0 < size <= MAX_HEADER_BYTES:
                return self._refuse(BAD_FRAME)
            self._buffer, self._got, self._stage = bytearray(size), 0, "header"
        elif self._stage == "header":
            self._on_header()
        else:
            self.transport.pause_reading()
            asyncio.ensure_future(self._finish())

    def _on_header(self) -> None:
        header = exchange_pb2.BulkHeader()
        try:
            header.ParseFromString(bytes(self._buffer))
        except Exception:  # protobuf's DecodeError; any malformed header is refused the same way
            return self._refuse(BAD_FRAME)
        if header.length <= 0 or len(header.tag) != TAG_BYTES or len(header.ticket) != TICKET_BYTES:
            return self._refuse(BAD_FRAME)
        status, claim = self.channel._take(header)
        if claim is None:
            return self._refuse(status)
        self._header, self._claim, self.key = header, claim, header.key
        # timed from the header on, so every byte of the body counts (TransferLog leaves the first read out), or
        # from the previous frame's last byte when this one waited in the socket while that one was taken
        now = time.perf_counter()
        self._sizes, self._arrivals = [0], [self._last_byte if now - self._resumed < BACK_TO_BACK_S else now]
        # numpy's empty is not zeroed first (bytearray's is): each page is touched once, by the socket's copy
        self._buffer, self._got, self._stage = memoryview(np.empty(header.length, dtype=np.uint8)), 0, "body"
        self._mac = Poly1305(claim.mac_key)

    async def _finish(self) -> None:
        header, claim, payload = self._header, self._claim, self._buffer
        self._claim, delivered = None, False  # released below, also if the connection drops meanwhile
        try:
            if not hmac.compare_digest(self._mac.finalize(), header.tag):
                status = MISMATCH
            else:
                delivered = await claim.deliver(payload, self._sizes, self._arrivals)
                status = OK if delivered else UNDELIVERED
        except Exception as e:  # the exchange failed to take it: the sender sends over libp2p
            logger.warning("bulk channel: a verified slice could not be delivered (%r)", e)
            status = UNDELIVERED
        finally:
            self.channel._release(header, claim, delivered=delivered)
        if status != OK:
            return self._refuse(status)
        self.channel.frames_taken += 1
        self.transport.write(bytes([OK]))
        last_byte = self._arrivals[-1]
        self._reset()
        self._last_byte, self._resumed = last_byte, time.perf_counter()
        self.transport.resume_reading()

    def _refuse(self, status: int) -> None:
        """Answer why, and close: the rest of the frame is not read (the sender falls back to libp2p)."""
        self.channel.drops.add(status)
        self._drop_claim()
        self.transport.write(bytes([status]))
        self.transport.close()

    def _drop_claim(self) -> None:
        if self._claim is not None:
            self.channel._release(self._header, self._claim, delivered=False)
            self._claim = None
