"""The messages of one slice on the wire (``exchange_pb2.TensorChunk``, ``CHUNK_BYTES`` of payload each),
made as the stream takes them: a slice of an elementwise codec (fp32, fp16, bf16: ``element_bytes``) is
encoded part by part, so its first bytes leave while the rest is still being encoded and no whole-slice
copy of the bytes is made; any other payload is cut from its encoded bytes. Either way the messages are
exactly those of the encoded slice cut into ``CHUNK_BYTES`` parts."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import AsyncIterator, Awaitable, Iterable, Optional

import torch

from swarm.net.bulk.transport import CHUNK_BYTES
from swarm.v1 import exchange_pb2


class SlicePayload:
    """What a send carries: encoded ``data``, or ``values`` (a 1-D fp32 view) that ``codec`` encodes per chunk."""

    def __init__(self, data: Optional[bytes] = None, *, codec=None, values: Optional[torch.Tensor] = None):
        self.data, self.codec, self.values = data, codec, values
        step = getattr(codec, "element_bytes", 0)
        self._per_chunk = CHUNK_BYTES // step if values is not None and step else 0
        self.size = len(data) if data is not None else values.numel() * step
        self._whole: Optional[bytes | memoryview] = data

    @staticmethod
    def lazy(codec, values: torch.Tensor) -> Optional["SlicePayload"]:
        """A payload encoded as it is sent, or None when ``codec`` cannot encode a slice part by part."""
        step = getattr(codec, "element_bytes", 0)
        return SlicePayload(codec=codec, values=values) if step and CHUNK_BYTES % step == 0 else None

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.size // CHUNK_BYTES))

    async def whole(self) -> bytes | memoryview:
        """The encoded slice in one piece (for the bulk channel): fp32 as a view of the vector's memory (its
        little-endian bytes are the encoding), other codecs encoded once, off the loop."""
        if self._whole is None:
            self._whole = self.lossless_view() or await asyncio.to_thread(self.codec.encode, self.values)
        return self._whole

    def lossless_view(self) -> Optional[memoryview]:
        """fp32 values' encoding without a copy: a view of their memory (on a little-endian machine)."""
        if (
            self.values is None
            or not self.codec.lossless
            or sys.byteorder != "little"
            or not self.values.is_contiguous()
        ):
            return None
        return memoryview(self.values.numpy()).cast("B")

    async def chunk(self, i: int) -> bytes:
        if isinstance(self._whole, bytes):  # given, or encoded for the bulk channel already
            return self._whole[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]
        part = self.values[i * self._per_chunk : (i + 1) * self._per_chunk]
        if self.codec.lossless:  # a plain copy of the fp32 bytes: cheaper than a hop to a thread
            return self.codec.encode(part)
        return await asyncio.to_thread(self.codec.encode, part)  # off the loop, which serves other streams


async def chunk_messages(
    payload: SlicePayload, head: dict, first_byte: list[float], sizes: list[int]
) -> AsyncIterator[exchange_pb2.TensorChunk]:
    """The slice's messages (``head``: its key, digest, phase, part, sender), each made when taken; notes
    in ``first_byte`` when the first is taken (the stream is open) and each message's size in ``sizes``."""
    num_chunks = payload.num_chunks
    for i in range(num_chunks):
        message = exchange_pb2.TensorChunk(**head, chunk=i, num_chunks=num_chunks, data=await payload.chunk(i))
        if not first_byte:
            first_byte.append(time.perf_counter())
        sizes.append(message.ByteSize())
        yield message


class Turn:
    """One send's place in a phase's order: its bytes go once the send before it is done (``after``: None
    for the first, or when sends go all at once) and, with a ``link`` (a lock: one per groupmate or one for all),
    once no other send holds that link (in the order the sends asked for it); it says when it is done itself,
    which frees the link."""

    def __init__(self, after: Optional[asyncio.Event] = None, *, link: Optional[asyncio.Lock] = None) -> None:
        self.after, self.finished, self.link, self._holds = after, asyncio.Event(), link, False

    @staticmethod
    def chain(count: int) -> list["Turn"]:
        """``count`` turns, each after the one before it."""
        turns: list[Turn] = []
        for _ in range(count):
            turns.append(Turn(turns[-1].finished if turns else None))
        return turns

    async def wait(self) -> None:
        if self.after is not None:
            await self.after.wait()
        if self.link is not None and not self._holds:
            await self.link.acquire()
            self._holds = True

    def done(self) -> None:
        self.finished.set()
        if self._holds:
            self._holds = False
            self.link.release()


async def settle(awaitables: Iterable[Awaitable]) -> list:
    """All results; on the first failure the rest are cancelled (and awaited) before it propagates."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await cancel_all(tasks)
        raise


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until they are done (their failures are no longer anyone's to report)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
