"""Wire formats for pseudo-gradients (a flat fp32 tensor in, raw little-endian bytes out, and back) and
the error feedback that carries what a lossy format dropped into the next round.

Every peer decodes the same bytes to the same fp32 values, on every machine: the codecs use only
correctly rounded IEEE operations (one division or multiplication per element, round-to-nearest-even)
and an absmax, which is exact whatever order it is taken in. Nothing is pickled.
"""

from __future__ import annotations

import numpy as np
import torch

from swarm.core.codec_base import BLOCK, Codec
from swarm.core.sparse_codec import VALUE_FORMATS, parse_topk


class RawFloatCodec(Codec):
    """Each element as an IEEE float of the wire dtype (little-endian), rounded to nearest even."""

    def __init__(self, name: str, wire_dtype: str, *, saturate: float | None = None) -> None:
        self.name = name
        self._wire = np.dtype(wire_dtype)
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
        if self._saturate is not None:
            values = np.clip(values, -self._saturate, self._saturate)
        return values.astype(self._wire, copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        values = np.frombuffer(data, dtype=self._wire, count=numel).astype(np.float32)  # a writable copy
        return torch.from_numpy(values)


class BFloat16Codec(Codec):
    """bfloat16: the top 16 bits of the fp32 pattern, rounded to nearest even (fp32's range, 8-bit
    mantissa). Done on the integer bits, so it does not depend on a library's conversion routine;
    values that would round past the largest finite bfloat16 are clamped to it."""

    name = "bf16"
    _MAX_BITS = 0x7F7F  # the largest finite bfloat16, 3.3895e38

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, t: torch.Tensor) -> bytes:
        bits = self._check_input(t).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round half to even on the dropped 16 bits
        sign, magnitude = rounded & 0x8000, np.minimum(rounded & 0x7FFF, self._MAX_BITS)
        return (sign | magnitude).astype("<u2").tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        half = np.frombuffer(data, dtype="<u2", count=numel)
        if ((half & 0x7F80) == 0x7F80).any():
            raise ValueError("codec bf16: the payload holds inf or nan, which encode never produces.")
        return torch.from_numpy((half.astype(np.uint32) << 16).view(np.float32))


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
        nb = self._num_blocks(n)
        padded = np.zeros(nb * self.block, dtype=np.float32)
        padded[:n] = values
        blocks = padded.reshape(nb, self.block)
        absmax = np.abs(blocks).max(axis=1) if nb else np.zeros(0, dtype=np.float32)
        scales = (absmax / np.float32(self.qmax)).astype(np.float32)
        # A zero block (or one whose absmax/qmax underflows to 0) is sent as zeros with scale 0.
        safe = np.where(scales > 0, scales, np.float32(1.0))
        q = np.rint(blocks / safe[:, None])  # np.rint rounds half to even
        q = np.where(scales[:, None] > 0, q, 0.0)
        # x/scale can reach qmax + a rounding; subnormal scales lose precision: clamp, never wrap.
        q = np.clip(q, -self.qmax, self.qmax).astype(np.int8).reshape(-1)[:n]
        if self.bits == 8:
            codes = q.tobytes()
        else:
            nibbles = (q.astype(np.int16) + 8).astype(np.uint8)
            if n % 2:
                nibbles = np.append(nibbles, np.uint8(8))
            codes = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()
        return scales.astype("<f4").tobytes() + codes

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        nb = self._num_blocks(numel)
        scales = np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError(f"codec {self.name}: a block scale is negative or not finite; the payload is corrupt.")
        raw = np.frombuffer(data, dtype=np.uint8, offset=4 * nb)
        if self.bits == 8:
            q = raw.view(np.int8)
            if (q == -128).any():
                raise ValueError("codec int8: the payload holds code -128, which encode never produces.")
        else:
            nibbles = np.empty(2 * raw.size, dtype=np.uint8)
            nibbles[0::2], nibbles[1::2] = raw & 0x0F, raw >> 4
            if (nibbles == 0).any() or (numel % 2 and nibbles[-1] != 8):
                raise ValueError("codec int4: the payload holds codes that encode never produces.")
            q = nibbles[:numel].astype(np.int8) - np.int8(8)
        per_element = np.repeat(scales, self.block)[:numel]
        return torch.from_numpy(q.astype(np.float32) * per_element)  # one rounding per element


CODECS: dict[str, Codec] = {
    "fp32": RawFloatCodec("fp32", "<f4"),
    "fp16": RawFloatCodec("fp16", "<f2", saturate=float(np.finfo(np.float16).max)),
    "bf16": BFloat16Codec(),
    "int8": BlockIntCodec("int8", 8),
    "int4": BlockIntCodec("int4", 4),
}
# The top-k family (swarm.core.sparse_codec), these names at the default density (1%);
# ``topk-int4@0.003`` names another density.
CODECS |= {f"topk-{values}": parse_topk(f"topk-{values}") for values in VALUE_FORMATS}


def get_codec(name: str | Codec) -> Codec:
    if isinstance(name, Codec):
        return name
    codec = CODECS.get(name) or parse_topk(name)
    if codec is None:
        raise ValueError(f"codec {name!r} is unknown; choose one of {sorted(CODECS)}"
                         " (topk codecs take a density: topk-int4@0.003).")
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
