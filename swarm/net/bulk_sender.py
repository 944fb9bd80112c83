"""The sending side of the bulk channel (``swarm.net.bulk_channel``): one frame per slice over a plain TCP
connection to the groupmate's bulk address, from blocking sockets in threads of its own, so the kernel's
copies run off the event loop and without the GIL, and an fp32 slice goes straight from the vector's memory.

Connections are kept per address and reused (no handshake or slow start per slice); one frame at a time
per connection. An address that cannot be dialled is not tried again for ``UNREACHABLE_RETRY_S`` (a peer
behind NAT announces none, or a firewalled one): its slices go over libp2p, as before the channel."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from swarm.net.bulk_channel import MAGIC, OK, PREFIX, STATUS_WORDS
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 600.0  # one frame's send and its status byte; an exchange's own timeout comes first
UNREACHABLE_RETRY_S = 600.0  # a firewalled port costs one connect timeout per this long, not one per round
MAX_IDLE_PER_ADDRESS = 4
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux; TCP paces itself without the fq qdisc
UNPACED = 0xFFFFFFFF  # the option's "no limit" (a u32)
Address = tuple[str, int]


class BulkSender:
    """Owned by the transport's event loop (``send``); the pool's threads only touch ``_idle`` under its lock."""

    def __init__(self, *, threads: int = 8) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="swarm-bulk")
        self._lock = threading.Lock()
        self._idle: dict[Address, list[socket.socket]] = {}  # under _lock
        self._busy: set[socket.socket] = set()  # under _lock: sockets a thread is sending on or reading from
        self._closed = False  # under _lock: after close() no thread starts a send (one racing it used to block exit)
        self._skip_until: dict[Address, float] = {}  # the loop's: addresses that could not be dialled

    async def send(self, address: Address, header: exchange_pb2.BulkHeader, data: bytes | memoryview, *,
                   pace_bytes_per_s: int = 0) -> Optional[float]:
        """Send one frame, at most ``pace_bytes_per_s`` (the kernel's TCP pacing, SO_MAX_PACING_RATE; 0:
        unpaced); when the receiver took it, the ``time.perf_counter`` at which its first byte went, else
        None (not dialled, refused, or the connection broke: the caller uses libp2p)."""
        if time.monotonic() < self._skip_until.get(address, 0.0):
            return None
        head = header.SerializeToString()
        in_use: list[socket.socket] = []  # the socket the thread is using, to cut it on cancellation
        try:
            started, status = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._send_frame, address, PREFIX.pack(MAGIC, len(head)) + head, data, pace_bytes_per_s,
                in_use)
        except asyncio.CancelledError:
            for sock in in_use:
                _close(sock)  # unblocks the thread's sendall or recv
            raise
        if status == "unreachable":
            self._skip_until[address] = time.monotonic() + UNREACHABLE_RETRY_S
            logger.info("bulk address %s:%d cannot be dialled; its slices go over libp2p for %.0fs", *address,
                        UNREACHABLE_RETRY_S)
        elif status != OK:
            logger.debug("bulk send to %s:%d not taken (%s); sending over libp2p", *address,
                         STATUS_WORDS.get(status, status))
        return started if status == OK else None

    def _send_frame(self, address: Address, head: bytes, data: bytes | memoryview, pace_bytes_per_s: int,
                    in_use: list[socket.socket]) -> tuple[float, object]:
        for attempt in range(2):
            sock, reused = self._checkout(address)
            if sock is None:
                return 0.0, "unreachable"
            in_use[:] = [sock]
            with self._lock:
                if self._closed:  # close() ran after this send was picked up: it would block on a fresh socket
                    _close(sock)
                    return 0.0, "connection failed (shutting down)"
                self._busy.add(sock)
            started = time.perf_counter()
            _pace(sock, pace_bytes_per_s)
            try:
                sock.sendall(head)
                sock.sendall(data)
                status = sock.recv(1)
            except OSError as e:
                _close(sock)
                if reused and attempt == 0:
                    continue  # a kept connection the receiver had closed meanwhile: one fresh try
                return started, f"connection failed ({e!r})"
            finally:
                with self._lock:
                    self._busy.discard(sock)
            if status == bytes([OK]):
                self._checkin(address, sock)
                return started, OK
            _close(sock)  # the receiver closes after a refusal
            return started, status[0] if status else "connection closed"
        return 0.0, "connection failed"

    def _checkout(self, address: Address) -> tuple[Optional[socket.socket], bool]:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        try:
            sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return None, False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(IO_TIMEOUT_S)
        return sock, False

    def _checkin(self, address: Address, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE_PER_ADDRESS:
                idle.append(sock)
                return
        _close(sock)

    def close(self) -> None:
        """Close every connection, also those a thread is still blocked on (a receiver that stopped reading while
        a forked child holds its socket open never resets it): the pool's threads, which the interpreter joins at
        exit, then end at once instead of after IO_TIMEOUT_S (a finished peer hung at exit in the suite)."""
        with self._lock:
            self._closed = True
            for idle in self._idle.values():
                for sock in idle:
                    _close(sock)
            self._idle.clear()
            for sock in self._busy:
                _close(sock)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _pace(sock: socket.socket, bytes_per_s: int) -> None:
    """Cap the connection's rate (0: no cap; a kept connection may have had one); where the system has no
    such option, the frame goes unpaced."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", min(UNPACED, bytes_per_s or UNPACED)))
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (any more)
    sock.close()
