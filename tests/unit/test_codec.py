"""Wire codecs: exact sizes, little-endian bytes, round-trip error bounds and refusal of bad input;
error feedback."""

import math

import numpy as np
import pytest
import torch

from swarm.core.average import part_bounds
from swarm.core.codecs.codec import BLOCK, CHUNK, CODECS, codec_round_trip, get_codec
from swarm.core.codecs.codec_base import all_finite
from swarm.core.codecs.error_feedback import ErrorFeedback

pytestmark = pytest.mark.timeout(60)


def _values(n=10_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 1e-4 .. 1e4: all inside fp16's normal range.
    mags = 10 ** (torch.rand(n, generator=g) * 8 - 4)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (mags * signs).to(torch.float32)


EXPECTED_SIZE = {
    "fp32": lambda n: 4 * n,
    "fp16": lambda n: 2 * n,
    "bf16": lambda n: 2 * n,
    "int8": lambda n: 4 * math.ceil(n / 64) + n,  # an fp32 scale per 64 elements, one byte each
    "int4": lambda n: 4 * math.ceil(n / 64) + math.ceil(n / 2),  # two codes per byte
    "sign": lambda n: 4 * math.ceil(n / 64) + math.ceil(n / 8),  # an fp32 scale per 64, one bit each
    "ternary": lambda n: 4 * math.ceil(n / 256) + math.ceil(n / 5),  # an fp32 level per 256, five codes a byte
}


def _topk_size(value_bytes):
    """topk at 1% in one chunk (n < 4096): k = ceil(n / 100) values, positions as uint16 offsets or a
    bitmap (whichever is smaller), values as ``value_bytes(k)``."""

    def size(n):
        if n == 0:
            return 0
        k = math.ceil(n / 100)
        return min(2 * k, math.ceil(n / 8)) + value_bytes(k)

    return size


EXPECTED_SIZE |= {
    "topk-fp16": _topk_size(lambda k: 2 * k),
    "topk-int8": _topk_size(lambda k: 4 * math.ceil(k / 64) + k),
    "topk-int4": _topk_size(lambda k: 4 * math.ceil(k / 64) + math.ceil(k / 2)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SIZE))
def test_encoded_size_is_exact(name):
    codec = CODECS[name]
    assert set(EXPECTED_SIZE) == set(CODECS)
    for n in (0, 1, 7, 63, 64, 65, 1000, 1001):
        data = codec.encode(_values(n, seed=n) if n else torch.ones(0))
        assert len(data) == codec.encoded_size(n) == EXPECTED_SIZE[name](n), n
        assert codec.decode(data, n).shape == (n,)


def test_block_sizes():
    assert [CODECS[n].block for n in ("fp32", "fp16", "bf16")] == [1, 1, 1]
    assert CODECS["topk-int4"].block == 4096  # a chunk: its top-k does not depend on other chunks
    assert CODECS["int8"].block == CODECS["int4"].block == BLOCK == 64


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
    # a sparse codec's size steps with k: take the first count whose size differs
    wrong = next(n for n in range(11, 10_000) if codec.encoded_size(n) != len(data))
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(data, wrong)
    for bad in (torch.ones(3, dtype=torch.float64), torch.ones(2, 2), torch.ones(6)[::2]):
        with pytest.raises(ValueError, match="1-D contiguous fp32"):
            codec.encode(bad)


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="fp16"):
        get_codec("int3")


def test_bf16_rounds_to_nearest_even_like_torch_and_saturates():
    x = _values(20_000, seed=3) * 1e3
    # ties: 1 + 2**-8 lies halfway between two bfloat16 values and must go to the even one (1.0)
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8)])
    y = torch.cat([x, ties])
    got = CODECS["bf16"].decode(CODECS["bf16"].encode(y), y.numel())
    assert torch.equal(got, y.to(torch.bfloat16).to(torch.float32))
    assert got[-3:].tolist() == [1.0, 1.0 + 2**-6, -1.0]
    big = torch.tensor([3.4e38, -3.4e38])
    assert torch.isfinite(CODECS["bf16"].decode(CODECS["bf16"].encode(big), 2)).all()


@pytest.mark.parametrize("name, qmax", [("int8", 127), ("int4", 7)])
def test_integer_codecs_error_is_at_most_half_a_step_of_each_blocks_absmax(name, qmax):
    codec = CODECS[name]
    # Blocks of very different magnitudes, so a shared scale would fail the bound.
    x = _values(64 * 50 + 17, seed=5)
    y = codec.decode(codec.encode(x), x.numel())
    for start in range(0, x.numel(), 64):
        block, back = x[start : start + 64].double(), y[start : start + 64].double()
        bound = block.abs().max().item() / qmax / 2
        assert (back - block).abs().max().item() <= bound * (1 + 1e-6), start


@pytest.mark.parametrize("name, qmax", [("int8", 127), ("int4", 7)])
def test_integer_codecs_round_half_to_even_and_keep_zeros(name, qmax):
    codec = CODECS[name]
    # absmax = qmax makes the scale exactly 1.0, so the codes are the rounded values themselves.
    x = torch.tensor([float(qmax), 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0] + [0.0] * 56 + [0.0] * 64)
    y = codec.decode(codec.encode(x), x.numel())
    assert y[:8].tolist() == [qmax, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 0.0]
    assert torch.equal(y[64:], torch.zeros(64))  # an all-zero block: scale 0, exact zeros


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 1.0])  # scale 1.0; codes q + 8 = 15, 1, 9 and a pad of 8
    assert CODECS["int4"].encode(x) == bytes.fromhex("0000803f") + bytes([0x1F, 0x89])
    x8 = torch.tensor([127.0, -127.0, 1.0])  # scale 1.0; two's complement bytes
    assert CODECS["int8"].encode(x8) == bytes.fromhex("0000803f") + bytes([0x7F, 0x81, 0x01])


@pytest.mark.parametrize("name", sorted(CODECS))
def test_block_aligned_slices_decode_exactly_like_the_whole_vector(name):
    codec = CODECS[name]
    x = _values(64 * 7 + 5, seed=9)
    whole = codec.decode(codec.encode(x), x.numel())
    for parts in (2, 3, 5):
        assert torch.equal(codec_round_trip(x, codec, part_bounds(x.numel(), parts, codec.block)), whole)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_non_finite_input_is_refused(name):
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="inf or nan"):
            CODECS[name].encode(torch.tensor([1.0, bad, 2.0]))


def test_corrupt_integer_payloads_are_refused():
    data8 = bytearray(CODECS["int8"].encode(torch.ones(10)))
    data8[4] = 0x80  # code -128
    data4 = bytearray(CODECS["int4"].encode(torch.ones(10)))
    data4[4] = 0xF0  # a low nibble of 0 is code -8
    for name, data in (("int8", data8), ("int4", data4)):
        with pytest.raises(ValueError, match="never produces"):
            CODECS[name].decode(bytes(data), 10)
    for scale in (-1.0, math.nan, math.inf):
        data = bytearray(CODECS["int8"].encode(torch.ones(10)))
        data[:4] = np.float32(scale).tobytes()
        with pytest.raises(ValueError, match="scale"):
            CODECS["int8"].decode(bytes(data), 10)
    with pytest.raises(ValueError, match="inf or nan"):
        CODECS["bf16"].decode(bytes.fromhex("807f"), 1)


def _reference_block_int(x: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """The integer codecs' scales and codes computed the plain way, the whole vector at once."""
    blocks = np.zeros(-(-x.size // BLOCK) * BLOCK, dtype=np.float32)
    blocks[: x.size] = x
    blocks = blocks.reshape(-1, BLOCK)
    scales = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(np.inf))
    codes = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int8).reshape(-1)[: x.size]
    return scales, codes


@pytest.mark.parametrize("name, qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + BLOCK + 3])
def test_integer_codecs_cut_into_chunks_write_what_one_pass_would(name, qmax, numel):
    """The integer codecs quantize and decode a chunk at a time: across chunk boundaries and a partial last
    block, the bytes and the decoded values are those of one pass over the whole vector."""
    x = _values(numel, seed=numel)
    x[CHUNK - 70 : CHUNK + 70] = 0  # zero blocks on both sides of the first boundary
    codec = CODECS[name]
    scales, codes = _reference_block_int(x.numpy(), qmax)
    data = codec.encode(x)
    assert data[: 4 * scales.size] == scales.astype("<f4").tobytes()
    got = np.frombuffer(data, dtype=np.uint8, offset=4 * scales.size)
    if name == "int8":
        assert np.array_equal(got.view(np.int8), codes)
    else:
        nibbles = np.stack([got & 0x0F, got >> 4], axis=1).reshape(-1).astype(np.int8) - 8
        assert np.array_equal(nibbles[:numel], codes) and (numel % 2 == 0 or nibbles[numel] == 0)
    expected = codes.astype(np.float32) * np.repeat(scales, BLOCK)[:numel]
    assert np.array_equal(codec.decode(data, numel).numpy(), expected)
    into = np.full(numel, np.nan, dtype=np.float32)
    codec.decode_into(data, into)
    assert np.array_equal(into, expected)


def test_a_scale_too_large_for_its_codes_is_refused_not_decoded_to_inf():
    """A finite scale whose codes overflow fp32 (only a crafted payload has one) is refused, in any chunk."""
    for name, qmax in (("int4", 7), ("int8", 127)):
        numel = CHUNK + 100
        data = bytearray(CODECS[name].encode(torch.ones(numel)))
        block = (CHUNK + 10) // BLOCK  # a block of the second chunk
        data[4 * block : 4 * block + 4] = np.float32(3e38).tobytes()
        with pytest.raises(ValueError, match="non-finite"):
            CODECS[name].decode(bytes(data), numel)


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_values_as_large_as_fp32_allows_are_sent_and_decode_finite(name):
    """absmax / qmax rounded up can make qmax × scale overflow (int8: 127 × fl(FLT_MAX / 127) does; int4's 7 ×
    fl(FLT_MAX / 7) stays below); encode then rounds that scale down instead of sending a payload that its own
    decode refuses."""
    big = float(np.finfo(np.float32).max)
    x = torch.zeros(2 * BLOCK)
    x[3], x[BLOCK + 1], x[5] = big, -big, 1.0
    y = CODECS[name].decode(CODECS[name].encode(x), x.numel())
    assert torch.isfinite(y).all()
    assert abs(y[3].item() / big - 1) < 1e-6 and abs(y[BLOCK + 1].item() / -big - 1) < 1e-6


def test_all_finite_is_exact_also_where_the_sum_overflows():
    assert all_finite(np.array([3e38, 3e38, -1.0], dtype=np.float32))  # the sum overflows; the values do not
    assert all_finite(np.zeros(0, dtype=np.float32))
    for bad in (math.nan, math.inf, -math.inf):
        values = np.ones(1000, dtype=np.float32)
        values[700] = bad
        assert not all_finite(values)
    assert not all_finite(np.array([np.inf, -np.inf], dtype=np.float32))  # the sum is nan


# ---- error feedback -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_error_feedback_loses_nothing_over_rounds(name):
    codec = CODECS[name]
    n = 64 * 20 + 3
    feedback = ErrorFeedback(n)
    inputs, decoded, scale = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    for r in range(12):
        delta = _values(n, seed=100 + r) * 1e-3
        sent = feedback.compensate(delta)
        got = codec_round_trip(sent, codec, part_bounds(n, 3, codec.block))
        feedback.update(sent, got)
        inputs += delta.double()
        decoded += got.double()
        scale += sent.double().abs() + got.double().abs()
    # Σ decoded = Σ Δ − final residual: exact in real arithmetic; in fp32 each + and − rounds once.
    residual = feedback.residual.double()
    assert ((decoded - (inputs - residual)).abs() <= scale * 2**-23).all()
    assert residual.abs().max() > 0


def test_error_feedback_sends_a_small_component_that_plain_int4_drops_forever():
    # In a block with one large value, int4 rounds every |x| < absmax/14 to zero: without error
    # feedback such a coordinate never moves; with it, the residual builds up until it is sent.
    delta = torch.zeros(64)
    delta[0], delta[1] = 7.0, 0.3
    codec, feedback = CODECS["int4"], ErrorFeedback(64)
    plain = sum(codec.decode(codec.encode(delta), 64)[1].item() for _ in range(10))
    compensated = 0.0
    for _ in range(10):
        sent = feedback.compensate(delta)
        got = codec.decode(codec.encode(sent), 64)
        feedback.update(sent, got)
        compensated += got[1].item()
    assert plain == 0.0
    assert abs(compensated - 3.0) <= 0.5 + 1e-6  # within one quantization step of the truth


def test_error_feedback_is_the_identity_while_nothing_was_lost():
    feedback = ErrorFeedback(3)
    delta = torch.tensor([-0.0, 1.0, -2.5])
    assert feedback.compensate(delta) is delta  # no +0.0 added: -0.0 keeps its sign bit
    feedback.update(delta, CODECS["fp32"].decode(CODECS["fp32"].encode(delta), 3))
    assert feedback.compensate(delta) is delta
    feedback.update(delta, torch.tensor([0.0, 1.0, -2.0]))
    assert torch.equal(feedback.compensate(delta), torch.tensor([-0.0, 1.0, -3.0]))
    with pytest.raises(ValueError, match="3 fp32 elements"):
        feedback.compensate(torch.zeros(4))
