"""Serving and fetching the committed global state (θg and the outer-optimizer state) between peers.

A peer publishes a safetensors snapshot of every state it commits; a joiner or a peer that fell out of
step downloads it in chunks from the holders the coordinator names and accepts it only when its hash
equals the committed hash of that round. Nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from hivemind.p2p import P2PContext, PeerID
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from swarm.core.state import state_hash
from swarm.net.transport import Transport
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


class StateUnavailable(RuntimeError):
    """No holder could serve a state with the committed hash."""


@dataclass(frozen=True)
class GlobalState:
    round: int
    params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    hash: str


def serialize_state(state: GlobalState) -> bytes:
    tensors = {f"param.{i:05d}": t.contiguous() for i, t in enumerate(state.params)}
    tensors.update({f"momentum.{i:05d}": t.contiguous() for i, t in enumerate(state.momentum)})
    return save_safetensors(tensors, metadata={"round": str(state.round), "hash": state.hash})


def deserialize_state(
    data: bytes, *, round_: int, shapes: Sequence[torch.Size], state_shapes: Optional[Sequence[torch.Size]] = None
) -> GlobalState:
    """Parse a snapshot; raises ValueError when it does not fit this model.

    shapes are the parameters'; state_shapes the outer optimizer's state tensors (default: one
    momentum tensor per parameter, as Nesterov SGD keeps).
    """
    state_shapes = list(shapes if state_shapes is None else state_shapes)
    try:
        tensors = load_safetensors(data)
    except Exception as e:
        raise ValueError(f"the state snapshot is not valid safetensors ({e})") from None
    params = [tensors.get(f"param.{i:05d}") for i in range(len(shapes))]
    momentum = [tensors.get(f"momentum.{i:05d}") for i in range(len(state_shapes))]
    if len(tensors) != len(shapes) + len(state_shapes) or any(t is None for t in params + momentum):
        raise ValueError("the state snapshot holds a different set of tensors than this model")
    for t, shape in zip(params + momentum, list(shapes) + state_shapes):
        if t.shape != shape:
            raise ValueError("the state snapshot's tensor shapes do not match this model")
    if any(t.dtype != torch.float32 for t in params):
        raise ValueError("the state snapshot's parameters are not fp32")
    return GlobalState(round=round_, params=params, momentum=momentum, hash=state_hash(params, momentum))


class StateServer:
    """Serves this peer's newest committed state to others."""

    def __init__(self, transport: Transport, *, run_id: str):
        self.transport = transport
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
        blob = serialize_state(state)
        with self._lock:
            self._round, self._hash, self._blob = state.round, state.hash, blob

    async def _on_request(self, request: exchange_pb2.StateRequest, context: P2PContext) -> exchange_pb2.StateChunk:
        with self._lock:
            round_, hash_, blob = self._round, self._hash, self._blob
        if round_ != request.round:
            return exchange_pb2.StateChunk(round=round_, error=f"this peer holds round {round_}")
        length = max(0, min(request.length, CHUNK_BYTES))
        data = blob[request.offset:request.offset + length]
        return exchange_pb2.StateChunk(
            round=round_, state_hash=hash_, total_bytes=len(blob), offset=request.offset, data=data
        )


def download_state(
    transport: Transport,
    *,
    run_id: str,
    holders: Sequence[str],
    round_: int,
    expected_hash: str,
    shapes: Sequence[torch.Size],
    timeout_s: float,
    state_shapes: Optional[Sequence[torch.Size]] = None,
) -> tuple[GlobalState, int]:
    """Fetch the state of round_, in chunks spread over every holder that serves it, and accept it
    only when its hash is expected_hash; returns (state, bytes).

    A holder that fails or moves on mid-download hands its chunks to the others (the download
    resumes where it was). If the assembled state has the wrong hash — a holder sent bad bytes — each
    holder is tried alone, so one bad holder cannot stop a peer from joining.
    """
    handler = f"swarm_{run_id}.state"
    sources = [h for h in holders if h != transport.peer_id]
    if not sources:
        raise StateUnavailable(f"no holder serves round {round_} (no holders: no other peer holds it)")
    deadline = time.monotonic() + timeout_s
    errors: list[str] = []
    for attempt in [sources] + ([[h] for h in sources] if len(sources) > 1 else []):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        names = "+".join(h[-8:] for h in attempt)
        try:
            blob = transport.run(_fetch(transport, attempt, handler, round_, expected_hash, errors),
                                 timeout_s=remaining)
            state = deserialize_state(blob, round_=round_, shapes=shapes, state_shapes=state_shapes)
        except Exception as e:
            errors.append(f"{names}: {e}")
            continue
        if state.hash != expected_hash:
            errors.append(f"{names}: served hash {state.hash}, committed is {expected_hash}")
            continue
        logger.info("downloaded round %d state (%d bytes) from %d holder(s)", round_, len(blob), len(attempt))
        return state, len(blob)
    raise StateUnavailable(f"no holder served round {round_} with hash {expected_hash} ({'; '.join(errors)})")


async def _fetch(transport: Transport, holders: Sequence[str], handler: str, round_: int, expected_hash: str,
                 errors: list[str]) -> bytes:
    async def request(holder: str, offset: int, length: int = CHUNK_BYTES) -> exchange_pb2.StateChunk:
        chunk = await transport.p2p.call_protobuf_handler(
            PeerID.from_base58(holder), handler,
            exchange_pb2.StateRequest(round=round_, offset=offset, length=length), exchange_pb2.StateChunk,
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
    serving = [(h, c) for h, c in serving if c.total_bytes == total]
    parts: dict[int, bytes] = {}
    todo = collections.deque(range(0, total, CHUNK_BYTES))

    async def worker(holder: str) -> None:
        while todo:
            offset = todo.popleft()
            try:
                chunk = await request(holder, offset)
                if chunk.total_bytes != total or not chunk.data:
                    raise RuntimeError("its state changed during the download")
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
