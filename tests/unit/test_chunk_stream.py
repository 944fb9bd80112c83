"""A slice encoded chunk by chunk as it is sent goes out as exactly the messages of its encoded bytes."""

import asyncio

import pytest
import torch

from swarm.core.codecs.codec import CODECS
from swarm.net.bulk.chunk_stream import SlicePayload, chunk_messages, settle
from swarm.net.bulk.transport import CHUNK_BYTES

pytestmark = pytest.mark.timeout(60)

HEAD = dict(key="run.1", group_digest="d", phase=1, part=2, sender=3)


def messages(payload: SlicePayload) -> list:
    async def collect():
        first_byte, sizes = [], []
        out = [m async for m in chunk_messages(payload, HEAD, first_byte, sizes)]
        assert first_byte and sizes == [m.ByteSize() for m in out]
        return out

    return asyncio.run(collect())


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("numel", [0, 1, 700_001])
def test_lazy_chunks_are_the_encoded_bytes_cut_in_chunks(name, numel):
    codec = CODECS[name]
    values = torch.randn(numel + 64, generator=torch.Generator().manual_seed(numel))[64:]  # a view, not at 0
    encoded = codec.encode(values.contiguous())
    expected = messages(SlicePayload(encoded))
    lazy = SlicePayload.lazy(codec, values)
    assert (lazy is not None) == (name in ("fp32", "fp16", "bf16"))  # only elementwise codecs go part by part
    got = messages(lazy or SlicePayload(encoded))
    assert [m.SerializeToString() for m in got] == [m.SerializeToString() for m in expected]
    assert b"".join(m.data for m in got) == encoded
    assert all(len(m.data) <= CHUNK_BYTES for m in got) and len(got) == max(1, -(-len(encoded) // CHUNK_BYTES))


def test_settle_cancels_the_rest_when_one_fails():
    async def scenario():
        never = asyncio.Event()
        waiting = asyncio.ensure_future(never.wait())

        async def fails():
            raise RuntimeError("a send failed")

        with pytest.raises(RuntimeError, match="a send failed"):
            await settle([waiting, fails()])
        return waiting.cancelled()

    assert asyncio.run(scenario())
