"""The encoded bytes of every dense codec, pinned for a fixed input: a faster encoder must send the same bits."""

import hashlib

import pytest
import torch

from swarm.core.codecs.codec import CODECS

pytestmark = pytest.mark.timeout(60)


def fixed_input() -> torch.Tensor:
    """Exactly computed values (integer ratios, correctly rounded): a mix of magnitudes, a zero block,
    subnormals, values past fp16's range and next to bf16's rounding ties, and an odd length."""
    i = torch.arange(10_001, dtype=torch.int64)
    values = ((i * 7919) % 2001 - 1000).to(torch.float32) / 37.0
    values[64:128] = 0.0  # a zero block: scale 0
    values[128:192] = values[128:192] * 1e-40  # subnormal values and scales
    values[192:256] = values[192:256] * 1e4  # past fp16's largest value: saturated
    values[256:320] = torch.tensor([1.0 + k * 2.0**-8 for k in range(64)])  # bf16 round-half-even ties
    values[320:384] = -values[320:384]
    values[-1] = 3.5  # the odd element of int4
    return values.contiguous()


PINNED = {  # codec: (sha256 of the encoded bytes, sha256 of the decoded fp32 values)
    "fp32": (
        "a2890790ea315808c0754c4675a07149ae41a6205c93907bafacf0f52b79b339",
        "a2890790ea315808c0754c4675a07149ae41a6205c93907bafacf0f52b79b339",
    ),
    "fp16": (
        "85cca931257a077037c8fc666e36caa8c0709ac361a16e616959e2d09b01479c",
        "105166798b4441855f57164c6883a40f3bf7202f499ba6a6847c4f986ef7bb65",
    ),
    "bf16": (
        "2e6c3eb73638f7196a063eb53d234f689f6e004d333f3c4becc067c4817518a0",
        "5909237318f6d6b27550af58760453b02c7f7084d262a4e7690c48bfddd33040",
    ),
    "int8": (
        "14c0889f22b168fd6f6f01afe132d58ca5b1de62b2affc960d69b55e54375d22",
        "4588dec84941677093cdbd54727f4781ba329b4390963b9f291c25f231a3a16f",
    ),
    "int4": (
        "7777e38a7eae45319a05e097b2ed8e171f34d7544f3d23e5774640ff2cd7f8eb",
        "88ab36728e9a0f175eda23c697ced613f79be5a30218d5bd32f1d7127adb0be7",
    ),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_encoded_and_decoded_bits_are_pinned(name):
    codec, values = CODECS[name], fixed_input()
    data = bytes(codec.encode(values))
    decoded = codec.decode(data, values.numel())
    assert (hashlib.sha256(data).hexdigest(), hashlib.sha256(decoded.numpy().tobytes()).hexdigest()) == PINNED[name]
    assert decoded.dtype == torch.float32 and decoded.numel() == values.numel()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_slices_encode_like_the_whole(name):
    """A slice that starts on a block boundary encodes to the same bytes whether or not it is a view."""
    codec, values = CODECS[name], fixed_input()
    view = values[128:4096]
    assert codec.encode(view) == codec.encode(view.clone())
    assert torch.equal(
        codec.decode(codec.encode(view), view.numel()), codec.decode(codec.encode(view.clone()), view.numel())
    )
