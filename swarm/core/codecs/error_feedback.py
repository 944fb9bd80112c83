"""Error feedback: what a lossy codec dropped of a peer's sent vector, carried into its next round
(``ErrorFeedback``), and the exchange turning a sent vector into that residual in place as it encodes it
(``DroppedInPlace``)."""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from swarm.core.codecs.codec_base import Codec


class DroppedInPlace:
    """A contribution's vector that the exchange turns, slice by slice as it encodes it, into what the codec dropped
    of it: ``values[s:e] ← values[s:e] − decode(encode(values[s:e]))``, from the very bytes it sends. Once every
    element is a slice's, the vector is error feedback's next residual (``ErrorFeedback.install``): the commit
    neither encodes the vector a second time nor makes a vector of its own. Bit for bit what ``codec_round_trip``
    and ``ErrorFeedback.update`` make (the slices start at multiples of the codec's ``block``: the same values as
    any other such cut; the same fp32 subtraction).

    Only the vector the trainer ``expect``s is turned (matched by its memory: the exchange sends a view of it). A
    turned vector is no longer Δ: nothing may send it again (a round's contribution is sent once; a voided one is
    made anew from θl, and its residual is the one error feedback still holds)."""

    _lock = threading.Lock()
    _expected: dict[int, "DroppedInPlace"] = {}  # by id: a few at a time (one per fragment in flight)

    def __init__(self, values: torch.Tensor) -> None:
        self._values = weakref.ref(values)
        self._ptr, self._numel = values.data_ptr(), values.numel()
        self.codec = ""  # the codec the slices were encoded with ("": none yet)
        self._slices: list[tuple[int, int]] = []

    @classmethod
    def expect(cls, values: torch.Tensor) -> "DroppedInPlace":
        """Turn ``values`` (1-D contiguous fp32 CPU) when an exchange encodes slices of it with a lossy codec."""
        entry = cls(values)
        with cls._lock:
            cls._expected = {k: e for k, e in cls._expected.items() if e._values() is not None}
            cls._expected[id(entry)] = entry
        return entry

    def forget(self) -> None:
        with self._lock:
            self._expected.pop(id(self), None)

    @classmethod
    def encoded(cls, flat: torch.Tensor, start: int, end: int, data: bytes, codec: Codec) -> None:
        """The exchange encoded ``flat[start:end]`` to ``data`` with ``codec`` (and will not read those values
        again): when ``flat`` is an expected vector and ``codec`` is lossy, the slice becomes what it dropped."""
        if codec.lossless or end <= start or flat.dtype != torch.float32 or not flat.is_contiguous():
            return
        with cls._lock:
            entry = next((e for e in cls._expected.values() if e._matches(flat)), None)
            if entry is None:
                return
            if entry.codec not in ("", codec.name):  # a second codec over the same vector: not one residual
                entry.codec = "?"
                return
            entry.codec = codec.name
        part = flat[start:end]
        torch.sub(part, codec.decode(data, end - start), out=part)
        with cls._lock:
            entry._slices.append((start, end))

    def _matches(self, flat: torch.Tensor) -> bool:
        values = self._values()
        return values is not None and flat.data_ptr() == self._ptr and flat.numel() == self._numel

    def residual(self, codec: Codec) -> Optional[torch.Tensor]:
        """The vector, now what ``codec`` dropped of all of it; None unless every element was turned by ``codec``."""
        values = self._values()
        if values is None or self.codec != codec.name:
            return None
        at = 0
        for start, end in sorted(self._slices):
            if start > at:
                return None
            at = max(at, end)
        return values if at >= self._numel else None

    @property
    def touched(self) -> bool:
        """Some slice was turned: the vector is no longer the Δ it was."""
        return bool(self._slices) or self.codec == "?"


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
        self._numel = numel
        # None while the residual is exactly zero (a lossless codec's, or before the first lossy round): no model-sized
        # vector is held for it, and compensate returns Δ itself: adding +0.0 would turn -0.0 into +0.0, and a
        # lossless codec must leave the bits of a run without error feedback unchanged.
        self._residual: Optional[torch.Tensor] = None

    @property
    def residual(self) -> torch.Tensor:
        """What the codec dropped so far (zeros made on request while it is zero: they are not kept)."""
        return self._residual if self._residual is not None else torch.zeros(self._numel, dtype=torch.float32)

    @property
    def is_zero(self) -> bool:
        return self._residual is None

    @property
    def numel(self) -> int:
        return self._numel

    def _check(self, t: torch.Tensor, what: str) -> None:
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != self.numel:
            raise ValueError(f"error feedback holds {self.numel} fp32 elements; {what} has {t.dtype} {tuple(t.shape)}.")

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """Δ + β·residual (a new tensor, or Δ itself while the residual is zero)."""
        self._check(delta, "the pseudo-gradient")
        residual = self._residual
        if residual is None:
            return delta
        return delta + residual if self.decay == 1.0 else delta + self.decay * residual

    def update(self, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remember what the codec lost: ``sent_input − decoded``."""
        self._check(sent_input, "the sent vector")
        self._check(decoded, "the decoded vector")
        self.install(sent_input - decoded)

    def install(self, residual: torch.Tensor) -> None:
        """``residual`` (what the codec dropped of the sent vector, ``DroppedInPlace``) is the residual now."""
        self._check(residual, "the residual")
        self._residual = residual if bool(residual.any()) else None

    def reset(self) -> None:
        self._residual = None
