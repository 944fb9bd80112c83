"""Wire formats for pseudo-gradients (a flat fp32 tensor in, raw little-endian bytes out, and back); the
error feedback that carries what a lossy format dropped into the next round is ``swarm.core.codecs.error_feedback``.

Every peer decodes the same bytes to the same fp32 values, on every machine: the codecs use only
correctly rounded IEEE operations (one division or multiplication per element, round-to-nearest-even)
and an absmax, which is exact whatever order it is taken in. Nothing is pickled.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings

import numpy as np
import torch

from swarm.core.codecs.codec_base import BLOCK, Codec
from swarm.core.codecs.lowrank_codec import parse_lowrank
from swarm.core.codecs.sign_codec import SignCodec
from swarm.core.codecs.sparse_codec import VALUE_FORMATS, parse_topk
from swarm.core.codecs.sparse_ternary_codec import parse_sparse_ternary
from swarm.core.codecs.ternary_codec import TernaryCodec


class RawFloatCodec(Codec):
    """Each element as an IEEE float of the wire dtype (little-endian), rounded to nearest even."""

    def __init__(self, name: str, wire_dtype: str, *, saturate: float | None = None) -> None:
        self.name = name
        self._wire = np.dtype(wire_dtype)
        # Each element encodes on its own to this many bytes: a sub-range of the input encodes to that
        # sub-range of the bytes, so a sender may encode a slice part by part as it sends it.
        self.element_bytes = self._wire.itemsize
        # fp16 overflows to inf above 65504; an inf in an averaged update would poison every peer's
        # parameters, so out-of-range values are clamped to the largest finite value instead.
        self._saturate = saturate

    @property
    def lossless(self) -> bool:
        return self._wire == np.dtype("<f4")

    def encoded_size(self, numel: int) -> int:
        return numel * self._wire.itemsize

    def encode(self, t: torch.Tensor) -> bytes:
        values = self._check_input(t)
        if self._wire == np.dtype("<f4"):
            return values.tobytes()  # the one copy: the bytes themselves
        # torch converts fp32 to fp16 with the same round-to-nearest-even as numpy, several times faster
        clamped = torch.from_numpy(values).clamp(-self._saturate, self._saturate)
        return clamped.to(torch.float16).numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        wire = np.frombuffer(data, dtype=self._wire, count=numel)
        if self._wire == np.dtype("<f4"):
            return torch.from_numpy(wire.copy())  # a writable copy
        return _readonly(wire).to(torch.float32)  # fp16 -> fp32 is exact; a new tensor

    def decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        self._check_length(data, out.size)
        np.copyto(out, np.frombuffer(data, dtype=self._wire, count=out.size))  # one copy; fp16 -> fp32 is exact


class BFloat16Codec(Codec):
    """bfloat16: the top 16 bits of the fp32 pattern, rounded to nearest even (fp32's range, 8-bit
    mantissa). Done on the integer bits, so it does not depend on a library's conversion routine;
    values that would round past the largest finite bfloat16 are clamped to it."""

    name = "bf16"
    element_bytes = 2  # each element on its own (see RawFloatCodec)
    _MAX_BITS = 0x7F7F  # the largest finite bfloat16, 3.3895e38

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, t: torch.Tensor) -> bytes:
        bits = self._check_input(t).view(np.uint32)
        # Round half to even on the dropped 16 bits, in place on one uint32 temporary: for finite fp32 bits
        # (at most 0xFF7FFFFF) adding at most 0x8000 never wraps.
        rounded = bits >> 16
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        half = rounded.astype("<u2")
        magnitude = half & 0x7FFF
        np.minimum(magnitude, self._MAX_BITS, out=magnitude)
        half &= 0x8000
        half |= magnitude
        return half.tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        half = np.frombuffer(data, dtype="<u2", count=numel)
        if ((half & 0x7F80) == 0x7F80).any():
            raise ValueError("codec bf16: the payload holds inf or nan, which encode never produces.")
        wide = half.astype(np.uint32)
        wide <<= 16
        return torch.from_numpy(wide.view(np.float32))


# The least exact value that rounds to fp32 infinity: FLT_MAX plus half its ulp (round to nearest even goes up there)
FP32_OVERFLOW = float(np.finfo(np.float32).max) + 2.0**103
CHUNK = 1 << 18  # elements the integer codecs code at a time (a multiple of BLOCK): 1 MiB of fp32 scratch, a core's L2


class BlockIntCodec(Codec):
    """Blockwise absmax quantization: every ``BLOCK`` consecutive elements share one scale.

    Layout: the block scales (fp32, little-endian, ``absmax / qmax`` rounded once), then the integer
    codes ``q = round_half_even(x / scale)`` in [-qmax, qmax] — int8 one per byte, int4 two per byte
    as ``q + 8`` (low nibble first; an odd count pads with the code of 0). Decoding is ``q * scale``:
    per element the error is at most ``scale / 2 = absmax / qmax / 2`` (up to fp32 rounding). fp32 scales
    cost 4 bytes per block more than fp16 ones would, but keep that bound for blocks of any magnitude.
    """

    decodes_finite = True

    def __init__(self, name: str, bits: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"BlockIntCodec supports 4 or 8 bits, got {bits}.")
        self.name = name
        self.bits = bits
        self.block = BLOCK
        self.qmax = (1 << (bits - 1)) - 1  # symmetric: 127 or 7, so -qmax..qmax and zero is exact
        self._qmax = torch.tensor(float(self.qmax), dtype=torch.float32)

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def _code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else -(-numel // 2)

    def encoded_size(self, numel: int) -> int:
        return 4 * self._num_blocks(numel) + self._code_bytes(numel)

    def encode(self, t: torch.Tensor) -> bytes:
        self._check_input(t, finite=False)  # inf/nan: a non-finite block scale
        values = t.detach()
        n = values.numel()
        full = n // self.block * self.block  # the whole blocks, quantized in place of a padded copy
        payload = _scratch_bytes(self.encoded_size(n))  # the scales, then the codes; copied out below
        head = 4 * self._num_blocks(n)
        scales = torch.from_numpy(payload[:head].view(np.float32))
        codes = torch.from_numpy(payload[head:])
        per_code = 1 if self.bits == 8 else 2  # elements per byte of codes
        scratch = _EncodeScratch.mine(min(full, CHUNK))
        for start in range(0, full, CHUNK):  # a chunk's temporaries stay in the core's cache
            end = min(full, start + CHUNK)
            self._encode_blocks(
                values[start:end],
                scales[start // self.block : end // self.block],
                codes[start // per_code : end // per_code],
                scratch,
            )
        if full < n:  # the last, partial block: zero-padded (so an odd int4 count pads with the code of 0)
            tail = torch.zeros(self.block, dtype=torch.float32)
            tail[: n - full] = values[full:]
            tail_codes = torch.empty(self.block // per_code, dtype=torch.uint8)
            self._encode_blocks(tail, scales[-1:], tail_codes, _EncodeScratch(self.block))
            codes[full // per_code :] = tail_codes[: codes.numel() - full // per_code]
        if sys.byteorder != "little":
            scales.numpy().byteswap(inplace=True)
        return payload.tobytes()

    def _encode_blocks(
        self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, scratch: "_EncodeScratch"
    ) -> None:
        """Fill ``scales`` (one per ``block`` elements of ``x``, a whole number of blocks) and ``codes`` (int8
        one per byte, int4 ``q + 8`` two per byte, low nibble first) from ``x``, in ``scratch``.

        torch's kernels, not numpy's: a max along rows of 64 and the float -> integer conversions are
        2.5-4x faster there. Every step is exact or one IEEE rounding (division, round half to even), so
        the bytes do not depend on the library or the CPU's vector width."""
        blocks = x.view(-1, self.block)
        scaled = scratch.work[: x.numel()].view(-1, self.block)
        torch.abs(blocks, out=scaled)
        torch.amax(scaled, dim=1, out=scales)  # exact, and nan propagates
        scales.div_(self._qmax)  # CPU kernels divide (inputs are CPU-only: _check_input); no reciprocal
        top = float(scales.max())  # one pass: nan or inf when a block holds one
        if not math.isfinite(top):
            raise ValueError(f"codec {self.name}: the tensor holds inf or nan; it cannot be sent.")
        if top * self.qmax >= FP32_OVERFLOW:  # absmax near FLT_MAX: qmax × scale would round to inf
            too_big = scales.double().mul_(self.qmax) >= FP32_OVERFLOW
            scales.copy_(torch.where(too_big, torch.nextafter(scales, torch.zeros_like(scales)), scales))
        # A zero block (or one whose absmax/qmax underflows to 0) is sent as zeros with scale 0: x / inf = ±0.
        safe = torch.where(scales > 0, scales, scratch.inf)
        torch.div(blocks, safe[:, None], out=scaled)
        scaled.round_()  # half to even
        # x/scale can reach qmax + a rounding; subnormal scales lose precision: clamp, never wrap.
        scaled.clamp_(-self.qmax, self.qmax)
        if self.bits == 8:
            codes.view(torch.int8).copy_(scaled.view(-1))
            return
        pairs = scaled.add_(8).view(-1, 2)  # codes 1..15; lo + 16·hi is exact in fp32
        packed = scratch.packed[: pairs.shape[0]]
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=packed)
        codes.copy_(packed)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        out = np.empty(numel, dtype=np.float32)
        self.decode_into(data, out)
        return torch.from_numpy(out)

    def decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        numel = out.size
        self._check_length(data, numel)
        scales = self._block_scales(data, numel)
        # Only a crafted scale can overflow its codes: q × scale is one rounding of the exact product and |q| ≤ qmax,
        # so every value is finite iff qmax × the largest scale (exact in fp64) rounds to a finite fp32, i.e. is
        # below FLT_MAX + half its ulp. One check of the scales instead of one of every value.
        if scales.size and float(scales.max()) * self.qmax >= FP32_OVERFLOW:
            raise ValueError(
                f"codec {self.name}: the payload decodes to non-finite values, which encode never produces."
            )
        raw = np.frombuffer(data, dtype=np.uint8, offset=4 * scales.size)
        scratch = _DecodeScratch(min(numel, CHUNK), self.bits)
        for start in range(0, numel, CHUNK):  # a chunk's temporaries stay in the core's cache
            end = min(numel, start + CHUNK)
            q = self._codes(raw, start, end, numel, scratch)
            self._scale_into(q, scales, start, end, numel, out)

    def _codes(self, raw: np.ndarray, start: int, end: int, numel: int, scratch: "_DecodeScratch") -> np.ndarray:
        """The int8 codes of elements [start, end) (``start`` even), checked against what encode writes."""
        if self.bits == 8:
            q = raw[start:end].view(np.int8)
            if (q == -128).any():
                raise ValueError("codec int8: the payload holds code -128, which encode never produces.")
            return q
        src = raw[start // 2 : (end + 1) // 2]
        wide, high = scratch.wide[: src.size], scratch.high[: src.size]
        np.copyto(wide, src)  # byte b -> (b & 0x0F) | (b >> 4) << 8: the two nibbles, low first
        np.bitwise_and(wide, 0xF0, out=high)
        high <<= 4
        wide &= 0x0F
        wide |= high
        nibbles = (wide if sys.byteorder == "little" else wide.byteswap()).view(np.uint8)
        if (nibbles == 0).any() or (end == numel and numel % 2 and nibbles[end - start] != 8):
            raise ValueError("codec int4: the payload holds codes that encode never produces.")
        q = scratch.q[: end - start]
        np.subtract(nibbles[: end - start].view(np.int8), np.int8(8), out=q)
        return q

    def _scale_into(self, q: np.ndarray, scales: np.ndarray, start: int, end: int, numel: int, out: np.ndarray) -> None:
        """out[start:end] = q × its blocks' scales: int8 -> fp32 is exact, then one rounding per element."""
        full = min(end, numel // self.block * self.block)  # the whole blocks of this chunk end here
        b0, b1 = start // self.block, full // self.block
        with np.errstate(over="ignore"):  # a crafted scale's overflow is refused by the caller's check
            if full > start:
                np.multiply(
                    q[: full - start].reshape(-1, self.block),
                    scales[b0:b1, None],
                    out=out[start:full].reshape(-1, self.block),
                    dtype=np.float32,
                )
            if full < end:  # the last, partial block
                np.multiply(q[full - start :], scales[-1:], out=out[full:end], dtype=np.float32)


_THREAD = threading.local()  # each thread's encode buffers: encodes run on several threads at once


KEEP_PAYLOAD_BYTES = 16 << 20  # the largest payload buffer a thread keeps (an exchange encodes a slice at a time;
# the default executor has up to 32 threads)


def _scratch_bytes(size: int) -> np.ndarray:
    """``size`` bytes of this thread's payload buffer, grown as needed and kept up to KEEP_PAYLOAD_BYTES: memory
    written by an earlier encode, so an encode's writes fault no fresh page (the kernel zeroes each one first)."""
    buffer = getattr(_THREAD, "payload", None)
    if buffer is not None and buffer.size >= size:
        return buffer[:size]
    buffer = np.empty(size, dtype=np.uint8)
    if size <= KEEP_PAYLOAD_BYTES:
        _THREAD.payload = buffer
    return buffer


class _EncodeScratch:
    """One encode's reusable buffers, a chunk long."""

    inf = torch.tensor(float("inf"))

    def __init__(self, numel: int) -> None:
        self.work = torch.empty(numel, dtype=torch.float32)
        self.packed = torch.empty(numel // 2, dtype=torch.float32)

    @classmethod
    def mine(cls, numel: int) -> "_EncodeScratch":
        """This thread's scratch of at least ``numel`` elements (kept, like its payload buffer)."""
        scratch = getattr(_THREAD, "scratch", None)
        if scratch is None or scratch.work.numel() < numel:
            scratch = _THREAD.scratch = cls(numel)
        return scratch


class _DecodeScratch:
    """One decode's reusable int4 unpacking buffers, a chunk long."""

    def __init__(self, numel: int, bits: int) -> None:
        pairs = (numel + 1) // 2 if bits == 4 else 0
        self.wide = np.empty(pairs, dtype=np.uint16)
        self.high = np.empty(pairs, dtype=np.uint16)
        self.q = np.empty(numel, dtype=np.int8)


def _readonly(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s read-only memory, only ever read (torch warns about such tensors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


CODECS: dict[str, Codec] = {
    "fp32": RawFloatCodec("fp32", "<f4"),
    "fp16": RawFloatCodec("fp16", "<f2", saturate=float(np.finfo(np.float16).max)),
    "bf16": BFloat16Codec(),
    "int8": BlockIntCodec("int8", 8),
    "int4": BlockIntCodec("int4", 4),
    "sign": SignCodec(),  # 1 bit per element (swarm.core.codecs.sign_codec)
    "ternary": TernaryCodec(),  # −level / 0 / +level, 1.725 bits per element (swarm.core.codecs.ternary_codec)
}
# The top-k family (swarm.core.codecs.sparse_codec), these names at the default density (1%);
# ``topk-int4@0.003`` names another density.
CODECS |= {f"topk-{values}": parse_topk(f"topk-{values}") for values in VALUE_FORMATS}


def get_codec(name: str | Codec) -> Codec:
    if isinstance(name, Codec):
        return name
    codec = CODECS.get(name) or parse_topk(name) or parse_sparse_ternary(name) or parse_lowrank(name, CODECS)
    if codec is None:
        raise ValueError(
            f"codec {name!r} is unknown; choose one of {sorted(CODECS)}"
            " (topk codecs take a density: topk-int4@0.003, and so does a sparse ternary one:"
            " ternary@0.1; low-rank ones a rank and values: lowrank4-fp16)."
        )
    return codec


def codec_round_trip(flat: torch.Tensor, codec: Codec | str, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """What the receivers decode when ``flat`` is sent as the slices ``bounds``: each slice encoded and
    decoded on its own, concatenated."""
    codec = get_codec(codec)
    if not bounds:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([codec.decode(codec.encode(flat[s:e].contiguous()), e - s) for s, e in bounds])
