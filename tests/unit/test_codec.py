"""Wire codecs: exact sizes, little-endian bytes, round-trip error bounds and refusal of bad input."""

import pytest
import torch

from swarm.codec import CODECS, get_codec

pytestmark = pytest.mark.timeout(60)


def _values(n=10_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 1e-4 .. 1e4: all inside fp16's normal range.
    mags = 10 ** (torch.rand(n, generator=g) * 8 - 4)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (mags * signs).to(torch.float32)


@pytest.mark.parametrize("name, width", [("fp32", 4), ("fp16", 2)])
def test_encoded_size_is_exact(name, width):
    codec = CODECS[name]
    for n in (0, 1, 7, 1000):
        data = codec.encode(torch.ones(n))
        assert len(data) == codec.encoded_size(n) == width * n
        assert codec.decode(data, n).shape == (n,)


def test_fp32_round_trip_is_exact():
    x = _values()
    assert torch.equal(CODECS["fp32"].decode(CODECS["fp32"].encode(x), x.numel()), x)


def test_fp16_relative_error_is_within_half_an_ulp():
    x = _values()
    y = CODECS["fp16"].decode(CODECS["fp16"].encode(x), x.numel())
    assert y.dtype == torch.float32
    assert ((y - x).abs() / x.abs()).max().item() <= 1e-3


def test_fp16_saturates_instead_of_overflowing_to_inf():
    x = torch.tensor([1e6, -1e6, 65504.0, 1.0])
    y = CODECS["fp16"].decode(CODECS["fp16"].encode(x), 4)
    assert torch.equal(y, torch.tensor([65504.0, -65504.0, 65504.0, 1.0]))


def test_bytes_are_little_endian_ieee():
    one = torch.tensor([1.0, -2.0])
    assert CODECS["fp32"].encode(one) == bytes.fromhex("0000803f000000c0")
    assert CODECS["fp16"].encode(one) == bytes.fromhex("003c00c0")


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_is_deterministic_and_decodes_to_a_fresh_tensor(name):
    codec = CODECS[name]
    x = _values(1001)
    data = codec.encode(x)
    assert data == codec.encode(x.clone())
    a, b = codec.decode(data, 1001), codec.decode(data, 1001)
    assert torch.equal(a, b)
    a.add_(1.0)  # writable, and not shared with the bytes or the other result
    assert torch.equal(b, codec.decode(data, 1001))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_wrong_lengths_and_bad_inputs_are_refused(name):
    codec = CODECS[name]
    data = codec.encode(torch.ones(10))
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(data[:-1], 10)
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(data, 11)
    for bad in (torch.ones(3, dtype=torch.float64), torch.ones(2, 2), torch.ones(6)[::2]):
        with pytest.raises(ValueError, match="1-D contiguous fp32"):
            codec.encode(bad)


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="fp16"):
        get_codec("int3")
