"""Wire formats for pseudo-gradients: a flat fp32 tensor in, raw little-endian bytes out, and back.

Every peer decodes the same bytes to the same fp32 values, on every machine; nothing is pickled.
Lossy codecs with scales (int8, int4) fit the same interface: ``encode`` returns all the bytes,
``encoded_size`` counts them exactly.
"""

from __future__ import annotations

import abc
import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


class Codec(abc.ABC):
    """Encodes a 1-D contiguous fp32 CPU tensor to bytes and decodes them to fp32."""

    name: str

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact number of bytes ``encode`` returns for ``numel`` elements."""

    @abc.abstractmethod
    def encode(self, t: torch.Tensor) -> bytes: ...

    @abc.abstractmethod
    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """A new fp32 tensor of ``numel`` elements; ValueError when ``data`` has the wrong length."""

    def _check_input(self, t: torch.Tensor) -> np.ndarray:
        if t.dtype != torch.float32 or t.dim() != 1 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"codec {self.name} encodes 1-D contiguous fp32 CPU tensors, got {t.dtype}"
                f" {tuple(t.shape)} on {t.device}."
            )
        return t.detach().numpy()

    def _check_length(self, data: bytes, numel: int) -> None:
        if len(data) != self.encoded_size(numel):
            raise ValueError(
                f"codec {self.name}: got {len(data)} bytes for {numel} elements,"
                f" expected {self.encoded_size(numel)}; the payload is truncated or not this codec."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class RawFloatCodec(Codec):
    """Each element as an IEEE float of the wire dtype (little-endian), rounded to nearest even."""

    def __init__(self, name: str, wire_dtype: str, *, saturate: float | None = None) -> None:
        self.name = name
        self._wire = np.dtype(wire_dtype)
        # fp16 overflows to inf above 65504; an inf in an averaged update would poison every peer's
        # parameters, so out-of-range values are clamped to the largest finite value instead.
        self._saturate = saturate

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


CODECS: dict[str, Codec] = {
    "fp32": RawFloatCodec("fp32", "<f4"),
    "fp16": RawFloatCodec("fp16", "<f2", saturate=float(np.finfo(np.float16).max)),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"codec {name!r} is unknown; choose one of {sorted(CODECS)}.") from None
