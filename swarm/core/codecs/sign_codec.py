"""A dense 1-bit wire format: each element's sign, and one scale per block of ``BLOCK`` elements
(EF-signSGD / 1-bit Adam style; error feedback carries what it drops into the next round).

Layout: the block scales (fp32, little-endian), then one bit per element, packed LSB first (bit 1:
the element decodes to −scale, bit 0: to +scale; a count that is not a multiple of 8 pads with 0 bits).
The scale is the block's mean |x|, the value that minimizes a sign code's L2 error. It is computed
with a fixed sequence of elementwise fp32 operations (|x| × 2⁻⁶, exact above the subnormals, then a pairwise tree of adds,
then one multiplication), so a sender gets the same bytes on every machine; decoding is ±scale, exact.

A butterfly slice owner re-encodes the averaged slice with this codec too, which loses about as much
as the first encoding: ``Codec.owner_feedback`` asks it to keep that residual for its next round
(``swarm.core.codecs.owner_feedback``). Run it with a plain outer step (lr 1, momentum 0): with the outer
momentum the late re-sent residuals are repeated for many rounds (docs/BENCHMARKS.md, "Dense 1-bit with error feedback").
"""

from __future__ import annotations

import numpy as np
import torch

from swarm.core.codecs.codec_base import BLOCK, Codec

_SHRINK = np.float32(1.0 / BLOCK)  # 2⁻⁶: the tree of 64 adds then cannot overflow


class SignCodec(Codec):
    """Sign × per-block mean |x|: 1 bit per element plus a 4-byte scale per ``BLOCK`` elements
    (1.5 bits per element at 64)."""

    name = "sign"
    block = BLOCK
    owner_feedback = True

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        return 4 * self._num_blocks(numel) + -(-numel // 8)

    def encode(self, t: torch.Tensor) -> bytes:
        values = self._check_input(t)
        n = values.size
        padded = np.zeros(self._num_blocks(n) * self.block, dtype=np.float32)
        np.abs(values, out=padded[:n])
        padded *= _SHRINK
        tree = padded.reshape(-1, self.block)
        while tree.shape[1] > 1:  # pairwise, in a fixed order: elementwise adds are correctly rounded
            half = tree.shape[1] // 2
            tree = tree[:, :half] + tree[:, half:]
        sums = tree[:, 0]
        # mean = Σ|x|/64 × 64/len: the last block may be short (its padding adds exact zeros)
        lengths = np.full(sums.size, self.block, dtype=np.float32)
        if n % self.block:
            lengths[-1] = n % self.block
        scales = (sums * (np.float32(self.block) / lengths)).astype("<f4")
        signs = np.packbits(values < 0, bitorder="little")
        return scales.tobytes() + signs.tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        scales = self._block_scales(data, numel)
        nb = scales.size
        packed = np.frombuffer(data, dtype=np.uint8, offset=4 * nb)
        bits = np.unpackbits(packed, bitorder="little")
        if bits[numel:].any():
            raise ValueError(
                f"codec {self.name}: the padding bits after the last element are set, which encode"
                " never does; the payload is corrupt."
            )
        magnitude = np.repeat(scales.astype(np.float32), self.block)[:numel]
        return torch.from_numpy(np.where(bits[:numel].astype(bool), -magnitude, magnitude))
