"""Fetching the committed global state (θg and the outer-optimizer state) from the peers that serve it
(``swarm.net.bulk.state_server``).

A peer publishes a safetensors snapshot of every state it commits; a joiner or a peer that fell out of
step downloads it in chunks from the holders the coordinator names and accepts it only when its hash
equals the committed hash of that round. Nothing is unpickled.

Only members download: a request carries the requester's credential, which the holder checks against the
run's coordinator and against the libp2p id that the secure channel authenticated for the stream. The
downloader believes nothing a holder announces before checking it against the size this model's shapes
imply: the total size, and each chunk's offset and length.

The downloader keeps ``WINDOW`` requests in flight per holder and writes every chunk straight into one buffer of
the announced size, whose views become the state's tensors. Where it has a bulk channel (``swarm.net.bulk.bulk_channel``) it claims a slot there for each request, with a
fresh one-time Poly1305 key and ticket sent to the holder over this authenticated stream, and the holder sends
the bytes as one frame over plain TCP (``BULK_FRAME_BYTES``), bypassing p2pd (~60 MB/s through it on a loaded
2-core host, 300-430 MB/s over the channel: scripts/bench_state_transfer.py). A holder that cannot reach the
channel answers over libp2p, and is asked over libp2p from then on.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
from typing import Optional, Sequence

import numpy as np
import torch

from swarm.core.state import GlobalState, decode_state, encoded_size_bound
from swarm.core.trust.credential import Member
from swarm.net.bulk.bulk_channel import BulkChannel, fresh_claim_secrets
from swarm.net.bulk.state_server import BULK_GROUP, MIN_CHUNK_BYTES
from swarm.net.bulk.transport import Transport
from swarm.net.hivemind_api import PeerID
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # asked per request over libp2p
BULK_FRAME_BYTES = 8 << 20  # asked per request over the bulk channel
WINDOW = 8  # requests in flight per holder
USE_BULK = True  # ask holders for frames over this peer's bulk channel (else every byte comes over libp2p)


class StateUnavailable(RuntimeError):
    """No holder could serve a state with the committed hash."""


def download_state(
    transport: Transport,
    *,
    member: Member,
    run_id: str,
    holders: Sequence[str],
    round_no: int,
    expected_hash: str,
    like: GlobalState,
    timeout_s: float,
) -> tuple[GlobalState, int]:
    """Fetch the state of ``round_no``, in chunks spread over every holder that serves it, and accept it
    only when it fits this model (``like``) and its hash is ``expected_hash``; returns (state, bytes).
    ``member``'s credential is shown to the holders.

    Each holder has ``WINDOW`` requests in flight; the chunks land in one buffer of the announced size, and
    the state's tensors are views of that buffer (no other copy of the state is made). A holder that fails
    or moves on mid-download hands its chunks to the others (the download resumes where it was). If the
    assembled state has the wrong hash — a holder sent bad bytes — each holder is tried alone, so one bad
    holder cannot stop a peer from joining.
    """
    if member is None:
        raise ValueError(
            "downloading the state needs this peer's credential (a credential.Member): holders serve members only."
        )
    sources = [h for h in holders if h != transport.peer_id]
    if not sources:
        raise StateUnavailable(f"no holder serves round {round_no} (no holders: no other peer holds it)")
    deadline = time.monotonic() + timeout_s
    errors: list[str] = []
    for attempt in [sources] + ([[h] for h in sources] if len(sources) > 1 else []):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        names = "+".join(h[-8:] for h in attempt)
        download = _Download(
            transport,
            f"swarm_{run_id}.state",
            round_no,
            expected_hash,
            errors,
            credential=member.credential,
            max_bytes=encoded_size_bound(like),
        )
        try:
            state, nbytes = _assemble(transport, download, attempt, like, timeout_s=remaining)
        except Exception as e:
            errors.append(f"{names}: {e}")
            continue
        finally:
            download = None  # a failed attempt's bytes are not kept while the next one fills its own
        if state.state_hash != expected_hash:
            errors.append(f"{names}: served hash {state.state_hash}, committed is {expected_hash}")
            state = None
            continue
        logger.info("downloaded round %d state (%d bytes) from %d holder(s)", round_no, nbytes, len(attempt))
        return state, nbytes
    raise StateUnavailable(f"no holder served round {round_no} with hash {expected_hash} ({'; '.join(errors)})")


def _assemble(
    transport: Transport, download: _Download, holders: Sequence[str], like: GlobalState, *, timeout_s: float
) -> tuple[GlobalState, int]:
    """One attempt of ``download_state``: the state ``download`` fetches from ``holders``, and its size in bytes.
    The state's tensors are views of the download's buffer, which lives as long as they do."""
    buffer = transport.run(download.run(holders), timeout_s=timeout_s)
    return decode_state(buffer, download.round_no, like=like), buffer.nbytes


class _Download:
    """One download of a state: ranges of it taken by ``WINDOW`` workers per holder, each landing in one buffer
    (over the bulk channel when the holder can reach it, else in libp2p chunks). Runs on the transport's loop."""

    def __init__(
        self,
        transport: Transport,
        handler: str,
        round_no: int,
        expected_hash: str,
        errors: list[str],
        *,
        credential: bytes,
        max_bytes: int,
    ) -> None:
        self.transport, self.handler, self.round_no, self.expected_hash = transport, handler, round_no, expected_hash
        self.errors, self.credential, self.max_bytes = errors, credential, max_bytes
        self.key = f"state/{round_no}/{os.urandom(8).hex()}"  # this download's claims on the bulk channel
        self.parts = itertools.count()
        self.done = False  # set when ``run`` returns: no frame still on its way may write into the buffer after that
        self.in_flight = 0
        self.changed = asyncio.Condition()  # a range was taken, or handed back
        self.todo: collections.deque = collections.deque()
        self.total, self.channel, self.buffer = 0, None, None

    async def request(self, holder: str, offset: int, length: int, **bulk) -> exchange_pb2.StateChunk:
        chunk = await self.transport.p2p.call_protobuf_handler(
            PeerID.from_base58(holder),
            self.handler,
            exchange_pb2.StateRequest(
                round=self.round_no, offset=offset, length=length, credential=self.credential, **bulk
            ),
            exchange_pb2.StateChunk,
        )
        if chunk.error:
            raise RuntimeError(chunk.error)
        if chunk.state_hash != self.expected_hash:
            raise RuntimeError(f"served hash {chunk.state_hash}, committed is {self.expected_hash}")
        return chunk

    async def run(self, holders: Sequence[str]) -> np.ndarray:
        # a zero-length probe: which holders serve this state, and its size (no chunk is fetched twice)
        first = await asyncio.gather(*(self.request(h, 0, 0) for h in holders), return_exceptions=True)
        serving = [(h, c) for h, c in zip(holders, first) if not isinstance(c, BaseException)]
        self.errors.extend(f"{h[-8:]}: {c}" for h, c in zip(holders, first) if isinstance(c, BaseException))
        if not serving:
            raise RuntimeError("no holder answered")
        total = self.total = serving[0][1].total_bytes
        if not 0 < total <= self.max_bytes:  # before anything is allocated for it
            raise RuntimeError(f"a holder announced a state of {total} bytes; this model's is at most {self.max_bytes}")
        serving = [(h, c) for h, c in serving if c.total_bytes == total]
        self.channel = await _bulk_channel(self.transport)
        self.buffer = _allocate(total)
        frame = BULK_FRAME_BYTES if self.channel is not None else CHUNK_BYTES
        self.todo.extend((offset, min(frame, total - offset)) for offset in range(0, total, frame))
        workers = []
        for holder, _ in serving:
            failed: list[bool] = []  # shared by the holder's workers: one failure stops them all
            bulk = [True] if self.channel is not None else []  # whether to ask it for frames over the bulk channel
            workers += [self.worker(holder, failed, bulk) for _ in range(WINDOW)]
        try:
            await asyncio.gather(*workers)
        finally:
            self.done = True
            if self.channel is not None:
                self.channel.forget(self.key)
        if self.todo:
            raise RuntimeError("every holder failed before the download completed")
        return self.buffer

    async def fetch(self, holder: str, offset: int, length: int, bulk: bool) -> int:
        """Fetch bytes from ``offset`` (``length`` at most) into the buffer; returns how many came."""
        channel, buffer = self.channel, self.buffer
        if bulk:
            mac_key, ticket = fresh_claim_secrets()
            slot = (BULK_GROUP, exchange_pb2.PHASE_UNSPECIFIED, next(self.parts), 0, ticket)
            landed: list[bool] = []

            async def deliver(payload: memoryview, _sizes: list[int], _arrivals: list[float]) -> bool:
                if self.done or landed or payload.nbytes != length:
                    return False
                buffer[offset : offset + length] = np.frombuffer(payload, dtype=np.uint8)
                landed.append(True)
                return True

            bulk = channel.claim(self.key, slot, length, mac_key, holder, deliver)  # False: no slot (asked over libp2p)
        fields = (
            dict(
                bulk_address=channel.address,
                bulk_key=self.key,
                bulk_part=slot[2],
                bulk_ticket=ticket,
                bulk_mac_key=mac_key,
            )
            if bulk
            else {}
        )
        asked = length if bulk else min(length, CHUNK_BYTES)
        try:
            chunk = await self.request(holder, offset, asked, **fields)
        finally:
            if bulk:
                channel.unclaim(self.key, slot)
        if chunk.total_bytes != self.total:
            raise RuntimeError("its state changed during the download")
        if chunk.bulk:
            if not (bulk and landed and chunk.offset == offset):
                raise RuntimeError(
                    f"it said it sent {length} bytes at {chunk.offset} over the bulk channel, which took none"
                )
            return length
        got = len(chunk.data)
        if chunk.offset != offset or not min(asked, MIN_CHUNK_BYTES) <= got <= asked:
            raise RuntimeError(f"asked for {asked} bytes at {offset}, it sent {got} at {chunk.offset}")
        buffer[offset : offset + got] = np.frombuffer(chunk.data, dtype=np.uint8)
        return got

    async def worker(self, holder: str, failed: list[bool], bulk: list[bool]) -> None:
        while not failed:
            async with self.changed:
                await self.changed.wait_for(lambda: self.todo or not self.in_flight or failed)
                if failed or not self.todo:
                    return
                offset, length = self.todo.popleft()
                self.in_flight += 1
            try:
                got = await self.fetch(holder, offset, length, bool(bulk))
            except Exception as e:
                if not failed:
                    self.errors.append(f"{holder[-8:]}: {e}")
                failed.append(True)
                got = 0
            if got < length and bulk:
                bulk.clear()  # the holder could not send over the bulk channel (not reachable?): libp2p from now on
            async with self.changed:
                if got < length:
                    self.todo.appendleft((offset + got, length - got))  # the rest, by this holder or another one
                self.in_flight -= 1
                self.changed.notify_all()


def _allocate(nbytes: int) -> np.ndarray:
    """The download's buffer. Not zeroed first (bytearray's is): each page is touched once, by its chunk's copy.
    torch's allocator rather than numpy's: numpy asks for transparent huge pages, and where the kernel compacts
    memory for them on the first touch (defrag "madvise"), filling a GB took 1-3 s instead of ~0.8 s here."""
    return torch.empty(nbytes, dtype=torch.uint8).numpy()


async def _bulk_channel(transport: Transport) -> Optional[BulkChannel]:
    """This transport's bulk channel when holders can send to it (an announced address), else None."""
    if not USE_BULK:
        return None
    try:
        channel = await transport.open_bulk()
    except Exception as e:  # e.g. no port to listen on: the state comes over libp2p
        logger.info("no bulk channel for the state download (%r); it comes over libp2p", e)
        return None
    return channel if channel.address else None
