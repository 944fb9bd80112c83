"""Wire formats for pseudo-gradients (a flat fp32 tensor in, raw little-endian bytes out, and back) and
the error feedback that carries what a lossy format dropped into the next round.

Every peer decodes the same bytes to the same fp32 values, on every machine: the codecs use only
correctly rounded IEEE operations (one division or multiplication per element, round-to-nearest-even)
and an absmax, which is exact whatever order it is taken in. Nothing is pickled.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from swarm.core.codec_base import BLOCK, Codec
from swarm.core.lowrank_codec import parse_lowrank
from swarm.core.sign_codec import SignCodec
from swarm.core.sparse_codec import VALUE_FORMATS, parse_topk
from swarm.core.sparse_ternary_codec import parse_sparse_ternary
from swarm.core.ternary_codec import TernaryCodec


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


class BlockIntCodec(Codec):
    """Blockwise absmax quantization: every ``BLOCK`` consecutive elements share one scale.

    Layout: the block scales (fp32, little-endian, ``absmax / qmax`` rounded once), then the integer
    codes ``q = round_half_even(x / scale)`` in [-qmax, qmax] — int8 one per byte, int4 two per byte
    as ``q + 8`` (low nibble first; an odd count pads with the code of 0). Decoding is ``q * scale``:
    per element the error is at most ``scale / 2 = absmax / qmax / 2`` (up to fp32 rounding). fp32 scales
    cost 4 bytes per block more than fp16 ones would, but keep that bound for blocks of any magnitude.
    """

    def __init__(self, name: str, bits: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"BlockIntCodec supports 4 or 8 bits, got {bits}.")
        self.name = name
        self.bits = bits
        self.block = BLOCK
        self.qmax = (1 << (bits - 1)) - 1  # symmetric: 127 or 7, so -qmax..qmax and zero is exact

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def _code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else -(-numel // 2)

    def encoded_size(self, numel: int) -> int:
        return 4 * self._num_blocks(numel) + self._code_bytes(numel)

    def encode(self, t: torch.Tensor) -> bytes:
        values = self._check_input(t)
        n = values.size
        full = n // self.block * self.block  # the whole blocks, quantized in place of a padded copy
        tail = np.zeros(self.block if full < n else 0, dtype=np.float32)
        tail[:n - full] = values[full:]
        scales = np.empty(self._num_blocks(n), dtype="<f4")
        q = np.empty(n + (n % 2 if self.bits == 4 else 0), dtype=np.int8)
        self._quantize(values[:full].reshape(-1, self.block), scales[:full // self.block], q[:full])
        if tail.size:
            codes = np.empty(self.block, dtype=np.int8)
            self._quantize(tail.reshape(1, self.block), scales[-1:], codes)
            q[full:n] = codes[:n - full]
        if self.bits == 8:
            return scales.tobytes() + q.tobytes()
        if n % 2:
            q[n] = 0  # an odd count pads with the code of 0
        q += 8  # codes 1..15, low nibble first: as uint16 pairs (little-endian) v = lo | hi << 8
        pairs = q.view(np.uint16) if sys.byteorder == "little" else q.view(np.uint16).byteswap()
        packed = pairs >> 4
        packed |= pairs  # lo | hi << 4 in the low byte
        return scales.tobytes() + packed.astype(np.uint8).tobytes()

    def _quantize(self, blocks: np.ndarray, scales: np.ndarray, q: np.ndarray) -> None:
        """Fill ``scales`` (one per row of ``blocks``) and the int8 codes ``q`` (row-major)."""
        if not blocks.size:
            return
        # exact, as |x| is; the outer abs (per block, cheap) makes a zero block's absmax +0, never -0
        absmax = np.abs(np.maximum(blocks.max(axis=1), -blocks.min(axis=1)))
        np.divide(absmax, np.float32(self.qmax), out=scales)
        # A zero block (or one whose absmax/qmax underflows to 0) is sent as zeros with scale 0: x / inf = ±0.
        safe = np.where(scales > 0, scales, np.float32(np.inf))
        scaled = blocks / safe[:, None]
        np.rint(scaled, out=scaled)  # np.rint rounds half to even
        # x/scale can reach qmax + a rounding; subnormal scales lose precision: clamp, never wrap.
        np.clip(scaled, -self.qmax, self.qmax, out=scaled)
        q[:] = scaled.reshape(-1)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        scales = self._block_scales(data, numel)
        nb = scales.size
        raw = np.frombuffer(data, dtype=np.uint8, offset=4 * nb)
        if self.bits == 8:
            q = raw.view(np.int8)
            if (q == -128).any():
                raise ValueError("codec int8: the payload holds code -128, which encode never produces.")
        else:
            wide = raw.astype(np.uint16)  # byte b -> (b & 0x0F) | (b >> 4) << 8: the two nibbles, low first
            high = wide & 0xF0
            high <<= 4
            wide &= 0x0F
            wide |= high
            nibbles = (wide if sys.byteorder == "little" else wide.byteswap()).view(np.uint8)
            if (nibbles == 0).any() or (numel % 2 and nibbles[-1] != 8):
                raise ValueError("codec int4: the payload holds codes that encode never produces.")
            q = nibbles[:numel].view(np.int8)
            q = q - np.int8(8)
        out = np.empty(numel, dtype=np.float32)
        full = numel // self.block * self.block
        # int8 -> fp32 is exact; then one rounding per element, the scale broadcast over its block
        np.multiply(q[:full].reshape(-1, self.block), scales[:full // self.block, None],
                    out=out[:full].reshape(-1, self.block), dtype=np.float32)
        np.multiply(q[full:], scales[nb - 1:] if full < numel else scales[:0], out=out[full:], dtype=np.float32)
        return torch.from_numpy(out)


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
    "sign": SignCodec(),  # 1 bit per element (swarm.core.sign_codec)
    "ternary": TernaryCodec(),  # −level / 0 / +level, 1.725 bits per element (swarm.core.ternary_codec)
}
# The top-k family (swarm.core.sparse_codec), these names at the default density (1%);
# ``topk-int4@0.003`` names another density.
CODECS |= {f"topk-{values}": parse_topk(f"topk-{values}") for values in VALUE_FORMATS}


def get_codec(name: str | Codec) -> Codec:
    if isinstance(name, Codec):
        return name
    codec = CODECS.get(name) or parse_topk(name) or parse_sparse_ternary(name) or parse_lowrank(name, CODECS)
    if codec is None:
        raise ValueError(f"codec {name!r} is unknown; choose one of {sorted(CODECS)}"
                         " (topk codecs take a density: topk-int4@0.003, and so does a sparse ternary one:"
                         " ternary@0.1; low-rank ones a rank and values: lowrank4-fp16).")
    return codec


def codec_round_trip(flat: torch.Tensor, codec: Codec | str, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """What the receivers decode when ``flat`` is sent as the slices ``bounds``: each slice encoded and
    decoded on its own, concatenated."""
    codec = get_codec(codec)
    if not bounds:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([codec.decode(codec.encode(flat[s:e].contiguous()), e - s) for s, e in bounds])


class ErrorFeedback:
    """One peer's error-feedback state for one vector (a fragment): what its codec dropped so far.

    Each round the peer sends ``compensate(Δ) = Δ + residual`` and then records ``update(sent, decoded)``,
    keeping ``residual = sent − decoded``: the part of the update the wire lost, to be sent next time.
    Over rounds Σ decoded = Σ Δ − residual, so nothing is lost for good. The residual is local to the
    peer (it is not part of the global state and is not averaged).

    With ``decay`` β < 1 (SparseLoCo's error feedback) the peer sends ``Δ + β·residual`` instead: what
    the wire dropped fades by β per round rather than waiting at full weight, so the accumulator acts as
    the outer momentum (run such codecs with a plain outer step, momentum 0). β = 1 is the classic rule,
    bit for bit.
    """

    def __init__(self, numel: int, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}; 1 keeps every dropped value.")
        self.decay = decay
        self.residual = torch.zeros(numel, dtype=torch.float32)
        # While the residual is exactly zero, compensate returns Δ itself: adding +0.0 would turn -0.0
        # into +0.0, and a lossless codec must leave the bits of a run without error feedback unchanged.
        self._zero = True

    @property
    def numel(self) -> int:
        return self.residual.numel()

    def _check(self, t: torch.Tensor, what: str) -> None:
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != self.numel:
            raise ValueError(f"error feedback holds {self.numel} fp32 elements; {what} has {t.dtype} {tuple(t.shape)}.")

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """Δ + β·residual (a new tensor, or Δ itself while the residual is zero)."""
        self._check(delta, "the pseudo-gradient")
        if self._zero:
            return delta
        return delta + self.residual if self.decay == 1.0 else delta + self.decay * self.residual

    def update(self, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remember what the codec lost: ``sent_input − decoded``."""
        self._check(sent_input, "the sent vector")
        self._check(decoded, "the decoded vector")
        self.residual = sent_input - decoded
        self._zero = not bool(self.residual.any())

    def reset(self) -> None:
        self.residual = torch.zeros(self.numel, dtype=torch.float32)
        self._zero = True
