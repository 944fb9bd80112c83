"""Serving and fetching the committed global state (θg and the outer-optimizer state) between peers.

A peer publishes a safetensors snapshot of every state it commits; a joiner or a peer that fell out of
step downloads it in chunks from the holders the coordinator names and accepts it only when its hash
equals the committed hash of that round. Nothing is unpickled.

Only members download: a request carries the requester's credential, which the holder checks against the
run's coordinator and against the libp2p id that the secure channel authenticated for the stream. The
downloader believes nothing a holder announces before checking it against the size this model's shapes
imply: the total size, and each chunk's offset and length.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Sequence

from hivemind.p2p import P2PContext, PeerID

from swarm.core.credential import CredentialError, Member
from swarm.core.state import GlobalState, decode_state, encode_state, encoded_size_bound
from swarm.net.transport import CHUNK_BYTES, Transport
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)


class StateUnavailable(RuntimeError):
    """No holder could serve a state with the committed hash."""


class StateServer:
    """Serves this peer's newest committed state to the run's other members (``member`` checks them)."""

    def __init__(self, transport: Transport, *, run_id: str, member: Member):
        if member is None:
            raise ValueError("a state server needs this peer's credential (a credential.Member) to tell members from strangers.")
        self.transport, self.member = transport, member
        self.handler_name = f"swarm_{run_id}.state"
        self._lock = threading.Lock()
        self._round = -1
        self._hash = ""
        self._blob = b""
        transport.run(
            transport.p2p.add_protobuf_handler(self.handler_name, self._on_request, exchange_pb2.StateRequest),
            timeout_s=30,
        )

    def publish(self, state: GlobalState) -> None:
        blob = encode_state(state)
        with self._lock:
            self._round, self._hash, self._blob = state.round_no, state.state_hash, blob

    async def _on_request(self, request: exchange_pb2.StateRequest, context: P2PContext) -> exchange_pb2.StateChunk:
        refusal = self._refusal(request, context)
        if refusal:
            return exchange_pb2.StateChunk(error=refusal)
        with self._lock:
            round_no, state_hash, blob = self._round, self._hash, self._blob
        if round_no != request.round:
            return exchange_pb2.StateChunk(round=round_no, error=f"this peer holds round {round_no}")
        if not 0 <= request.offset <= len(blob) or request.length < 0:
            return exchange_pb2.StateChunk(round=round_no, error=f"offset {request.offset} or length {request.length} "
                                                                 f"is outside the state's {len(blob)} bytes")
        length = min(request.length, CHUNK_BYTES)
        data = blob[request.offset:request.offset + length]
        return exchange_pb2.StateChunk(
            round=round_no, state_hash=state_hash, total_bytes=len(blob), offset=request.offset, data=data
        )


    def _refusal(self, request: exchange_pb2.StateRequest, context: P2PContext) -> str:
        """Why this request gets no bytes ('' when it may have them)."""
        try:
            credential = self.member.check(request.credential, now=time.time())
        except CredentialError as e:
            return f"refused: only members of this run download its state ({e})"
        if credential.dht_peer_id != context.remote_id.to_base58():
            return f"refused: the credential of {credential.peer_id} is for another libp2p id than this stream's"
        return ""


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

    A holder that fails or moves on mid-download hands its chunks to the others (the download
    resumes where it was). If the assembled state has the wrong hash — a holder sent bad bytes — each
    holder is tried alone, so one bad holder cannot stop a peer from joining.
    """
    if member is None:
        raise ValueError("downloading the state needs this peer's credential (a credential.Member): holders serve members only.")
    handler = f"swarm_{run_id}.state"
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
        try:
            blob = transport.run(_fetch(transport, attempt, handler, round_no, expected_hash, errors,
                                        credential=member.credential, max_bytes=encoded_size_bound(like)),
                                 timeout_s=remaining)
            state = decode_state(blob, round_no, like=like)
        except Exception as e:
            errors.append(f"{names}: {e}")
            continue
        if state.state_hash != expected_hash:
            errors.append(f"{names}: served hash {state.state_hash}, committed is {expected_hash}")
            continue
        logger.info("downloaded round %d state (%d bytes) from %d holder(s)", round_no, len(blob), len(attempt))
        return state, len(blob)
    raise StateUnavailable(f"no holder served round {round_no} with hash {expected_hash} ({'; '.join(errors)})")


async def _fetch(transport: Transport, holders: Sequence[str], handler: str, round_no: int, expected_hash: str,
                 errors: list[str], *, credential: bytes, max_bytes: int) -> bytes:
    async def request(holder: str, offset: int, length: int = CHUNK_BYTES) -> exchange_pb2.StateChunk:
        chunk = await transport.p2p.call_protobuf_handler(
            PeerID.from_base58(holder), handler,
            exchange_pb2.StateRequest(round=round_no, offset=offset, length=length, credential=credential),
            exchange_pb2.StateChunk,
        )
        if chunk.error:
            raise RuntimeError(chunk.error)
        if chunk.state_hash != expected_hash:
            raise RuntimeError(f"served hash {chunk.state_hash}, committed is {expected_hash}")
        return chunk

    # a zero-length probe: which holders serve this state, and its size (no chunk is fetched twice)
    first = await asyncio.gather(*(request(h, 0, length=0) for h in holders), return_exceptions=True)
    serving = [(h, c) for h, c in zip(holders, first) if not isinstance(c, BaseException)]
    errors.extend(f"{h[-8:]}: {c}" for h, c in zip(holders, first) if isinstance(c, BaseException))
    if not serving:
        raise RuntimeError("no holder answered")
    total = serving[0][1].total_bytes
    if not 0 < total <= max_bytes:  # before anything is allocated for it
        raise RuntimeError(f"a holder announced a state of {total} bytes; this model's is at most {max_bytes}")
    serving = [(h, c) for h, c in serving if c.total_bytes == total]
    parts: dict[int, bytes] = {}
    todo = collections.deque(range(0, total, CHUNK_BYTES))

    async def worker(holder: str) -> None:
        while todo:
            offset = todo.popleft()
            try:
                chunk = await request(holder, offset)
                if chunk.total_bytes != total:
                    raise RuntimeError("its state changed during the download")
                if chunk.offset != offset or len(chunk.data) != min(CHUNK_BYTES, total - offset):
                    raise RuntimeError(f"asked for {min(CHUNK_BYTES, total - offset)} bytes at {offset}, "
                                       f"it sent {len(chunk.data)} at {chunk.offset}")
            except Exception as e:
                todo.append(offset)  # another holder picks it up: the download resumes, not restarts
                errors.append(f"{holder[-8:]}: {e}")
                return
            parts[offset] = chunk.data

    await asyncio.gather(*(worker(h) for h, _ in serving))
    if todo:
        raise RuntimeError("every holder failed before the download completed")
    blob = b"".join(parts[offset] for offset in sorted(parts))
    if len(blob) != total:
        raise RuntimeError(f"assembled {len(blob)} of {total} bytes")
    return blob
