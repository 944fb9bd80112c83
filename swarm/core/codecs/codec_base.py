"""The wire-format interface every pseudo-gradient codec implements (``swarm.core.codecs.codec`` lists them)."""

from __future__ import annotations

import abc

import numpy as np
import torch

BLOCK = 64  # elements per absmax block of the integer codecs: a scale costs 4/64 = 0.06 bytes per element


FINITE_CHUNK = 1 << 18  # elements checked at a time: the check's scratch stays in cache


def all_finite(values: np.ndarray, scratch: np.ndarray | None = None) -> bool:
    """Whether every element of the 1-D float array is finite, a cache-sized chunk at a time (``scratch``: a bool
    buffer to reuse); a whole-array ``isfinite`` would first write a temporary as long as the array."""
    if values.size <= FINITE_CHUNK and scratch is None:
        return bool(np.isfinite(values).all())
    scratch = scratch if scratch is not None else np.empty(FINITE_CHUNK, dtype=bool)
    for start in range(0, values.size, scratch.size):
        part = values[start : start + scratch.size]
        finite = scratch[: part.size]
        np.isfinite(part, out=finite)
        if not finite.all():
            return False
    return True


class Codec(abc.ABC):
    """Encodes a 1-D contiguous fp32 CPU tensor to bytes and decodes them to fp32.

    ``block`` is the number of elements that share encoding state (1 for the float codecs). A caller that
    cuts a vector into slices starting at multiples of ``block`` gets, concatenated, exactly the values
    it would get by coding the whole vector at once.
    """

    name: str
    block: int = 1
    gathered: bool = False  # True: exchanged by all-gather (swarm.net.exchange.sparse_gather), not by the butterfly
    # True: a butterfly slice owner keeps what re-encoding its averaged slice lost and adds it next round
    # (swarm.core.codecs.owner_feedback), with error feedback on; for codecs too coarse to re-encode for free.
    owner_feedback: bool = False
    # True: a low-rank projection exchanged as two butterflies of its factors (swarm.core.codecs.lowrank)
    lowrank: bool = False
    # True: ``encode``'s size depends on the values (an entropy code), ``encoded_size`` is the most it returns,
    # and the bytes a round sends are counted from its payloads (the simulator's pair_bytes; the real exchange takes
    # each slice's length from its message and counts what it sent).
    variable_size: bool = False
    # True: ``decode`` raises ValueError rather than return a non-finite value (callers need not check again)
    decodes_finite: bool = False

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact number of bytes ``encode`` returns for ``numel`` elements (``variable_size``: the most)."""

    @abc.abstractmethod
    def encode(self, t: torch.Tensor) -> bytes:
        """The bytes of ``t``; ValueError when ``t`` is not 1-D contiguous fp32 on the CPU or holds inf/nan."""

    @abc.abstractmethod
    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """A new fp32 tensor of ``numel`` elements; ValueError when ``data`` has the wrong length or could
        not have come from ``encode``."""

    @property
    def lossless(self) -> bool:
        return False

    def decode_into(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """``decode`` written into ``out`` (1-D fp32, as many elements as ``data`` holds)."""
        out[:] = self.decode(data, out.size).numpy()

    def _check_input(self, t: torch.Tensor, *, finite: bool = True) -> np.ndarray:
        """``t``'s values; ``finite=False``: the caller checks them for inf and nan itself."""
        if t.dtype != torch.float32 or t.dim() != 1 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"codec {self.name} encodes 1-D contiguous fp32 CPU tensors, got {t.dtype}"
                f" {tuple(t.shape)} on {t.device}."
            )
        values = t.detach().numpy()
        if finite and not all_finite(values):
            raise ValueError(f"codec {self.name}: the tensor holds inf or nan; it cannot be sent.")
        return values

    def _check_length(self, data: bytes, numel: int) -> None:
        if numel < 0 or len(data) != self.encoded_size(numel):
            raise ValueError(
                f"codec {self.name}: got {len(data)} bytes for {numel} elements,"
                f" expected {self.encoded_size(max(numel, 0))}; the payload is truncated or not this codec."
            )

    def _block_scales(self, data: bytes, numel: int) -> np.ndarray:
        """The fp32 scales that head ``data``, one per ``block`` elements; ValueError when one is negative or
        not finite (``encode`` never writes such a scale)."""
        scales = np.frombuffer(data, dtype="<f4", count=-(-numel // self.block))
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError(f"codec {self.name}: a block scale is negative or not finite; the payload is corrupt.")
        return scales

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
