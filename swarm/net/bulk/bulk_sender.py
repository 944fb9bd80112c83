"""The sending side of the bulk channel (``swarm.net.bulk.bulk_channel``): frames over a plain TCP connection to the
groupmate's bulk address, from blocking sockets in threads of its own, so the kernel's copies run off the event
loop and without the GIL, and an fp32 slice goes straight from the vector's memory.

One connection per address, kept and reused (no handshake or slow start per slice), on which frames go back to
back: a frame is written as soon as the one before it is written, and the receiver's status bytes come back in
the frames' order (the receiver takes one frame at a time per connection). Waiting for each status before the
next frame would idle the link for a round trip per frame — on a loaded link the status byte queues behind the
receiver's own uploads, tens of milliseconds per frame. A refused frame closes the connection (the receiver
stops reading): that frame and those behind it are answered "not taken", and their slices go over libp2p.
An address that cannot be dialled is not tried again for ``UNREACHABLE_RETRY_S`` (a peer behind NAT announces
none, or a firewalled one): its slices go over libp2p, as before the channel."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from swarm.net.bulk.bulk_channel import MAGIC, OK, PREFIX, STATUS_WORDS
from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL, set_congestion
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 600.0  # one frame's send and its status byte; an exchange's own timeout comes first
UNREACHABLE_RETRY_S = 600.0  # a firewalled port costs one connect timeout per this long, not one per round
THREADS = 32  # frames written or waiting for their status at once, all addresses together
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux; TCP paces itself without the fq qdisc
UNPACED = 0xFFFFFFFF  # the option's "no limit" (a u32)
Address = tuple[str, int]


class _Pipe:
    """One connection to an address: frames written one after another (``writing``), their status bytes read in
    the same order (the frame numbered ``read`` reads next)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writing = threading.Lock()
        self.turns = threading.Condition()
        self.written = 0  # frames written (under ``writing``)
        self.read = 0  # status bytes read (under ``turns``)
        self.broken = False  # under ``turns``: a refusal or an error closed it; frames behind it are not taken
        self.pace = 0  # bytes per second the connection is paced at (0: unpaced, as a new socket is)


class BulkSender:
    """Owned by the transport's event loop (``send``); the pool's threads touch ``_pipes`` only under its lock."""

    def __init__(self, *, threads: int = THREADS, congestion: str = CONGESTION_CONTROL) -> None:
        self.congestion = congestion  # for connections dialled from now on (``SYSTEM``: the system's default)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="swarm-bulk")
        self._lock = threading.Lock()
        self._pipes: dict[Address, _Pipe] = {}  # under _lock
        self._closed = False  # under _lock: after close() no thread starts a send (one racing it used to block exit)
        self._skip_until: dict[Address, float] = {}  # the loop's: addresses that could not be dialled

    async def send(
        self,
        address: Address,
        header: exchange_pb2.BulkHeader,
        data: bytes | memoryview,
        *,
        pace_bytes_per_s: int = 0,
        on_written: Optional[Callable[[], None]] = None,
    ) -> Optional[float]:
        """Send one frame, at most ``pace_bytes_per_s`` (the kernel's TCP pacing, SO_MAX_PACING_RATE; 0:
        unpaced); ``on_written()`` is called on the loop once its bytes are written (the next frame to the address
        may go). When the receiver took it, the ``time.perf_counter`` at which its first byte went, else None (not
        dialled, refused, or the connection broke: the caller uses libp2p)."""
        if time.monotonic() < self._skip_until.get(address, 0.0):
            return None
        loop = asyncio.get_running_loop()
        head = header.SerializeToString()
        told: list[bool] = []

        def written() -> None:  # from the thread, once
            if on_written is not None and not told:
                told.append(True)
                try:
                    loop.call_soon_threadsafe(on_written)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

        in_use: list[_Pipe] = []  # the connection the thread is using, to cut it on cancellation
        try:
            started, status = await loop.run_in_executor(
                self._pool,
                self._send_frame,
                address,
                PREFIX.pack(MAGIC, len(head)) + head,
                data,
                pace_bytes_per_s,
                written,
                in_use,
            )
        except asyncio.CancelledError:
            for pipe in in_use:
                self._break(address, pipe)  # unblocks the thread's sendall or recv
            raise
        if status == "unreachable":
            self._skip_until[address] = time.monotonic() + UNREACHABLE_RETRY_S
            logger.info(
                "bulk address %s:%d cannot be dialled; its slices go over libp2p for %.0fs",
                *address,
                UNREACHABLE_RETRY_S,
            )
        elif status != OK:
            logger.debug(
                "bulk send to %s:%d not taken (%s); sending over libp2p", *address, STATUS_WORDS.get(status, status)
            )
        return started if status == OK else None

    def _send_frame(
        self,
        address: Address,
        head: bytes,
        data: bytes | memoryview,
        pace_bytes_per_s: int,
        written: Callable[[], None],
        in_use: list[_Pipe],
    ) -> tuple[float, object]:
        try:
            for attempt in range(2):
                pipe, reused = self._pipe(address)
                if pipe is None:
                    return 0.0, "unreachable" if not self._closed else "connection failed (shutting down)"
                in_use[:] = [pipe]
                with pipe.writing:
                    number, started = pipe.written, time.perf_counter()
                    try:
                        if pipe.pace != pace_bytes_per_s:  # set once: each setting restarts the kernel's pacing
                            _pace(pipe.sock, pace_bytes_per_s)
                            pipe.pace = pace_bytes_per_s
                        pipe.sock.sendall(head)
                        pipe.sock.sendall(data)
                    except OSError as e:
                        self._break(address, pipe)
                        if reused and attempt == 0 and number == pipe.read:
                            continue  # a kept connection the receiver had closed meanwhile: one fresh try
                        return started, f"connection failed ({e!r})"
                    pipe.written += 1
                written()
                return started, self._status(address, pipe, number)
            return 0.0, "connection failed"
        finally:
            written()  # also when it was not: the next frame to the address need not wait for this one

    def _status(self, address: Address, pipe: _Pipe, number: int) -> object:
        """The receiver's answer to frame ``number`` of ``pipe``, read once the answers before it are."""
        with pipe.turns:
            pipe.turns.wait_for(lambda: pipe.read == number or pipe.broken)
            if pipe.broken:
                return "connection closed"
            try:
                status = pipe.sock.recv(1)
            except OSError as e:
                status = f"connection failed ({e!r})"
            pipe.read += 1
            if status != bytes([OK]):
                self._break(address, pipe)  # the receiver closes after a refusal
                return status[0] if isinstance(status, bytes) and status else status or "connection closed"
            pipe.turns.notify_all()
            return OK

    def _pipe(self, address: Address) -> tuple[Optional[_Pipe], bool]:
        """The address's connection (dialled now if there is none), and whether it was kept from before."""
        with self._lock:
            if self._closed:
                return None, False
            pipe = self._pipes.get(address)
            if pipe is not None:
                return pipe, True
        try:
            sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return None, False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_congestion(sock, self.congestion)
        sock.settimeout(IO_TIMEOUT_S)
        with self._lock:
            if self._closed:  # close() ran meanwhile: it would block on a fresh socket nobody closes
                _close(sock)
                return None, False
            kept = self._pipes.get(address)
            if kept is not None:  # another thread dialled it first
                _close(sock)
                return kept, True
            pipe = self._pipes[address] = _Pipe(sock)
            return pipe, False

    def _break(self, address: Optional[Address], pipe: _Pipe) -> None:
        """Close ``pipe`` (the frames still waiting for their status are not taken) and forget it."""
        with self._lock:
            if address is not None and self._pipes.get(address) is pipe:
                del self._pipes[address]
        _close(pipe.sock)
        with pipe.turns:
            pipe.broken = True
            pipe.turns.notify_all()

    def close(self) -> None:
        """Close every connection, also those a thread is still blocked on (a receiver that stopped reading while
        a forked child holds its socket open never resets it): the pool's threads, which the interpreter joins at
        exit, then end at once instead of after IO_TIMEOUT_S (a finished peer hung at exit in the suite)."""
        with self._lock:
            self._closed = True
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            self._break(None, pipe)
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
