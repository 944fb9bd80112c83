"""Top-k sparse wire formats: per chunk of the flat pseudo-gradient, only the k largest-magnitude values
(with their chunk-local positions) go over the wire; error feedback (``swarm.core.codecs.error_feedback.ErrorFeedback``)
keeps the rest for later rounds, as SparseLoCo does.

A chunk holds ``CHUNK`` consecutive elements (the vector's last one may be shorter) and sends
``k = ceil(density × its length)`` values (at least one). Per chunk, in this order within each of two
sections (the full chunks, then the short last one):

- the positions: k uint16 offsets within the chunk, strictly increasing, or, where that is smaller
  (density above ~1/16), a bitmap of the chunk with exactly k bits set (LSB first);
- the values, in position order: fp16 (clamped to ±65504), or int8 / int4 codes with one fp32 absmax
  scale per 64 of the chunk's selected values (``swarm.core.codecs.codec.BlockIntCodec``'s rule: q = round half
  even(x / scale), decoded as q × scale; int4 codes packed two per byte over the section, low nibble first).

The encoded size depends only on the element count, so a peer knows what to expect. Which values a tie
keeps is the sender's choice; receivers decode the bytes they got, so every receiver decodes the same
vector. Chunks are independent, so (``Codec.block`` = ``CHUNK``) slices cut at chunk boundaries encode
to the same values as the whole vector.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.core.codecs.codec_base import BLOCK, Codec

CHUNK = 4096  # elements per chunk: offsets fit uint16 (a chunk may hold up to 65,536)
VALUE_FORMATS = {"fp16": 16, "int8": 8, "int4": 4}
_FP16_MAX = float(np.finfo(np.float16).max)


class TopKCodec(Codec):
    """The k largest-magnitude values of every chunk, in ``values`` (fp16, int8 or int4) format."""

    gathered = True  # exchanged by all-gather (swarm.net.exchange.sparse_gather): sums of sparse vectors are not sparse

    def __init__(self, values: str, density: float, *, chunk: int = CHUNK) -> None:
        if values not in VALUE_FORMATS:
            raise ValueError(f"topk values must be one of {list(VALUE_FORMATS)}, got {values!r}.")
        if not (isinstance(density, float) and math.isfinite(density) and 0 < density <= 1):
            raise ValueError(f"topk density must be a fraction in (0, 1], got {density!r}.")
        if not 1 <= chunk <= 65536:
            raise ValueError(f"topk chunks hold 1 to 65,536 elements, got {chunk}.")
        self.values, self.density, self.block = values, density, chunk
        self.bits = VALUE_FORMATS[values]
        self.name = topk_name(values, density)

    def k(self, length: int) -> int:
        return max(1, min(length, math.ceil(self.density * length)))

    def _bitmap(self, length: int) -> bool:
        return -(-length // 8) < 2 * self.k(length)

    def _section_bytes(self, chunks: int, length: int) -> int:
        if chunks == 0:
            return 0
        k = self.k(length)
        positions = -(-length // 8) if self._bitmap(length) else 2 * k
        if self.bits == 16:
            values = 2 * k * chunks
        else:
            codes = k * chunks if self.bits == 8 else -(-(k * chunks) // 2)
            values = 4 * -(-k // BLOCK) * chunks + codes
        return positions * chunks + values

    def _sections(self, numel: int) -> list[tuple[int, int, int]]:
        """(first element, chunks, chunk length) of the full chunks and of the short last one."""
        full, tail = divmod(numel, self.block)
        return [(0, full, self.block), (full * self.block, 1 if tail else 0, tail)]

    def encoded_size(self, numel: int) -> int:
        return sum(self._section_bytes(c, n) for _, c, n in self._sections(max(numel, 0)))

    def encode(self, t: torch.Tensor) -> bytes:
        values = self._check_input(t)
        out = []
        for start, chunks, length in self._sections(values.size):
            if chunks:
                out.append(self._encode_section(values[start : start + chunks * length].reshape(chunks, length)))
        return b"".join(out)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        out = np.zeros(numel, dtype=np.float32)
        offset = 0
        for start, chunks, length in self._sections(numel):
            size = self._section_bytes(chunks, length)
            if chunks:
                section = self._decode_section(data[offset : offset + size], chunks, length)
                out[start : start + chunks * length] = section.reshape(-1)
            offset += size
        return torch.from_numpy(out)

    def _encode_section(self, m: np.ndarray) -> bytes:
        chunks, length = m.shape
        k = self.k(length)
        if k == length:
            picked = np.broadcast_to(np.arange(length), (chunks, length))
        else:
            picked = np.sort(np.argpartition(-np.abs(m), k - 1, axis=1)[:, :k], axis=1)
        chosen = np.take_along_axis(m, picked, axis=1)
        if self._bitmap(length):
            mask = np.zeros((chunks, length), dtype=bool)
            np.put_along_axis(mask, picked, True, axis=1)
            positions = np.packbits(mask, axis=1, bitorder="little").tobytes()
        else:
            positions = picked.astype("<u2").tobytes()
        return positions + self._encode_values(chosen)

    def _encode_values(self, chosen: np.ndarray) -> bytes:
        if self.bits == 16:
            return np.clip(chosen, -_FP16_MAX, _FP16_MAX).astype("<f2").tobytes()
        chunks, k = chosen.shape
        groups = -(-k // BLOCK)
        padded = np.zeros((chunks, groups * BLOCK), dtype=np.float32)
        padded[:, :k] = chosen
        blocks = padded.reshape(chunks, groups, BLOCK)
        qmax = (1 << (self.bits - 1)) - 1
        scales = (np.abs(blocks).max(axis=2) / np.float32(qmax)).astype(np.float32)
        safe = np.where(scales > 0, scales, np.float32(1.0))
        q = np.where(scales[..., None] > 0, np.rint(blocks / safe[..., None]), 0.0)
        q = np.clip(q, -qmax, qmax).astype(np.int8).reshape(chunks, groups * BLOCK)[:, :k].reshape(-1)
        if self.bits == 8:
            codes = q.tobytes()
        else:
            nibbles = (q.astype(np.int16) + 8).astype(np.uint8)
            if nibbles.size % 2:
                nibbles = np.append(nibbles, np.uint8(8))
            codes = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()
        return scales.astype("<f4").tobytes() + codes

    def _decode_section(self, data: bytes, chunks: int, length: int) -> np.ndarray:
        k = self.k(length)
        if self._bitmap(length):
            size = chunks * -(-length // 8)
            bits = np.unpackbits(
                np.frombuffer(data, np.uint8, count=size).reshape(chunks, -1), axis=1, bitorder="little"
            )
            if bits[:, length:].any() or (bits.sum(axis=1) != k).any():
                raise ValueError(f"codec {self.name}: a chunk's bitmap does not mark exactly {k} of its values.")
            picked = np.nonzero(bits[:, :length])[1].reshape(chunks, k)
        else:
            size = 2 * chunks * k
            picked = np.frombuffer(data, "<u2", count=chunks * k).astype(np.int64).reshape(chunks, k)
            if (picked >= length).any() or (np.diff(picked, axis=1) <= 0).any():
                raise ValueError(f"codec {self.name}: chunk offsets are out of range or not increasing.")
        out = np.zeros((chunks, length), dtype=np.float32)
        np.put_along_axis(out, picked, self._decode_values(data[size:], chunks, k), axis=1)
        return out

    def _decode_values(self, data: bytes, chunks: int, k: int) -> np.ndarray:
        if self.bits == 16:
            values = np.frombuffer(data, "<f2", count=chunks * k).astype(np.float32)
            if not np.isfinite(values).all():
                raise ValueError(f"codec {self.name}: the payload holds inf or nan, which encode never produces.")
            return values.reshape(chunks, k)
        groups = -(-k // BLOCK)
        scales = np.frombuffer(data, "<f4", count=chunks * groups).astype(np.float32).reshape(chunks, groups)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError(f"codec {self.name}: a scale is negative or not finite; the payload is corrupt.")
        raw = np.frombuffer(data, np.uint8, offset=4 * chunks * groups)
        if self.bits == 8:
            q = raw.view(np.int8)
            if (q == -128).any():
                raise ValueError(f"codec {self.name}: the payload holds code -128, which encode never produces.")
        else:
            nibbles = np.empty(2 * raw.size, dtype=np.uint8)
            nibbles[0::2], nibbles[1::2] = raw & 0x0F, raw >> 4
            if (nibbles == 0).any() or (nibbles.size > chunks * k and nibbles[-1] != 8):
                raise ValueError(f"codec {self.name}: the payload holds codes that encode never produces.")
            q = nibbles[: chunks * k].astype(np.int8) - np.int8(8)
        per_value = np.repeat(scales, BLOCK, axis=1)[:, :k]
        return q.reshape(chunks, k).astype(np.float32) * per_value


DEFAULT_DENSITY = 0.01


def topk_name(values: str, density: float) -> str:
    """The codec's name on the wire and in ``swarm status``: ``topk-int4`` at the default density,
    else ``topk-int4@0.003``."""
    return f"topk-{values}" if density == DEFAULT_DENSITY else f"topk-{values}@{density:g}"


def parse_topk(name: str) -> TopKCodec | None:
    """The TopKCodec a name like ``topk-int4`` or ``topk-int4@0.003`` stands for; None when it is not one."""
    if not name.startswith("topk-"):
        return None
    values, _, density = name[len("topk-") :].partition("@")
    try:
        return TopKCodec(values, float(density) if density else DEFAULT_DENSITY)
    except ValueError:
        return None


def density_note(name: str) -> str:
    """What a topk codec name sends, for people (`` (1% of values)``); "" for other codecs."""
    codec = parse_topk(name)
    return "" if codec is None else f" ({codec.density * 100:.4g}% of values)"
