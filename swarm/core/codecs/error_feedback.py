"""Error feedback: what a lossy codec dropped of a peer's sent vector, carried into its next round
(``ErrorFeedback``), and the exchange turning a sent vector into that residual as it encodes it
(``DroppedInPlace``): in the vector's own memory, or, for a peer that keeps its residuals in files
(``SpilledResidual``), into a file, which frees the vector's memory for the exchange's result."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch

from swarm.core.codecs.codec_base import Codec

PIECE = 1 << 22  # elements compensated at a time in place (a decayed residual's product: 16 MB, not a vector)


class SpilledResidual:
    """A residual in a file of its own (fp32, element i at byte 4·i), not in the process's memory: the page cache
    holds it while the kernel has room, and a peer reads it back once a round, a piece at a time, as it adds it to
    its next Δ (``ErrorFeedback.compensate``). Written a slice at a time, from any thread (disjoint slices)."""

    def __init__(self, path: Path, numel: int) -> None:
        self.path, self.numel = Path(path), numel
        self._fd: Optional[int] = None  # the file is made at the first write (a lossless round makes none)
        self._opening = threading.Lock()
        self.nonzero = False  # some element written is not zero (-0.0 counts as zero, as ``any`` says)

    def _file(self) -> int:
        with self._opening:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            return self._fd

    def write(self, start: int, values: torch.Tensor) -> None:
        """Elements ``start`` to ``start + len(values)``."""
        data = memoryview(values.detach().to(torch.float32).contiguous().numpy()).cast("B")
        at, fd = 4 * start, self._file()
        while data.nbytes:
            written = os.pwrite(fd, data, at)
            data, at = data[written:], at + written
        if not self.nonzero and bool(values.any()):
            self.nonzero = True

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``start`` to ``start + len(out)`` into ``out`` (1-D contiguous fp32)."""
        view = memoryview(out.numpy()).cast("B")
        at, got, fd = 4 * start, 0, self._file()
        while got < view.nbytes:
            n = os.preadv(fd, [view[got:]], at + got)
            if n <= 0:
                raise OSError(f"error feedback's residual file {self.path} is shorter than its {self.numel} elements")
            got += n
        return out

    def tensor(self) -> torch.Tensor:
        """The whole residual, read into a new vector (a checkpoint writes it)."""
        return self.read(0, torch.empty(self.numel, dtype=torch.float32))

    def delete(self) -> None:
        with self._opening:
            if self._fd is None:
                return
            os.close(self._fd)
            self._fd = None
        self.path.unlink(missing_ok=True)


class ResidualFiles:
    """Where one peer keeps its residuals (``directory``, emptied of an earlier process's files): one file per
    residual, named by fragment and a counter, so a round's new residual never overwrites the one it may fall back on."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("f*.residual"):
            stale.unlink(missing_ok=True)
        self._counter = itertools.count()

    def new(self, fragment: int, numel: int) -> SpilledResidual:
        return SpilledResidual(self.directory / f"f{fragment:03d}.{next(self._counter):06d}.residual", numel)


class DroppedInPlace:
    """A contribution's vector that the exchange turns, slice by slice as it encodes it, into what the codec dropped
    of it: ``values[s:e] ← values[s:e] − decode(encode(values[s:e]))``, from the very bytes it sends. Once every
    element is a slice's, the vector is error feedback's next residual (``ErrorFeedback.install``): the commit
    neither encodes the vector a second time nor makes a vector of its own. Bit for bit what ``codec_round_trip``
    and ``ErrorFeedback.update`` make (the slices start at multiples of the codec's ``block``: the same values as
    any other such cut; the same fp32 subtraction).

    Only the vector the trainer ``expect``s is turned (matched by its memory: the exchange sends a view of it). A
    turned vector is no longer Δ: nothing may send it again (a round's contribution is sent once; a voided one is
    made anew from θl, and its residual is the one error feedback still holds).

    With ``spill`` (a ``SpilledResidual``) each slice's residual is written to that file instead and the vector's
    values are left as they are; once a slice is encoded the exchange may write its result there (``spills``)."""

    _lock = threading.Lock()
    _expected: dict[int, "DroppedInPlace"] = {}  # by id: a few at a time (one per fragment in flight)

    def __init__(self, values: torch.Tensor, spill: Optional[SpilledResidual] = None) -> None:
        self._values = weakref.ref(values)
        self._ptr, self._numel = values.data_ptr(), values.numel()
        self.spill = spill
        self.codec = ""  # the codec the slices were encoded with ("": none yet)
        self._slices: list[tuple[int, int]] = []

    @classmethod
    def expect(cls, values: torch.Tensor, spill: Optional[SpilledResidual] = None) -> "DroppedInPlace":
        """Turn ``values`` (1-D contiguous fp32 CPU) when an exchange encodes slices of it with a lossy codec (into
        ``spill`` when given)."""
        entry = cls(values, spill)
        with cls._lock:
            cls._expected = {k: e for k, e in cls._expected.items() if e._values() is not None}
            cls._expected[id(entry)] = entry
        return entry

    def forget(self) -> None:
        with self._lock:
            self._expected.pop(id(self), None)

    @classmethod
    def spills(cls, flat: torch.Tensor, codec: Codec) -> bool:
        """``flat`` is an expected vector whose residual goes to a file as each slice of it is encoded whole with the
        lossy ``codec`` (not an elementwise one, whose slices are encoded chunk by chunk as they are sent,
        ``swarm.net.bulk.chunk_stream``): once a slice is encoded, nothing reads its values again."""
        if codec.lossless or getattr(codec, "element_bytes", 0):
            return False
        with cls._lock:
            return any(e.spill is not None and e._matches(flat) for e in cls._expected.values())

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
        if entry.spill is not None:
            entry.spill.write(start, torch.sub(part, codec.decode(data, end - start)))
        else:
            torch.sub(part, codec.decode(data, end - start), out=part)
        with cls._lock:
            entry._slices.append((start, end))

    def _matches(self, flat: torch.Tensor) -> bool:
        values = self._values()
        return values is not None and flat.data_ptr() == self._ptr and flat.numel() == self._numel

    def residual(self, codec: Codec) -> "Optional[torch.Tensor | SpilledResidual]":
        """The vector (or its spill file), now what ``codec`` dropped of all of it; None unless every element was
        turned by ``codec``."""
        values = self._values() if self.spill is None else self.spill
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
        self._residual: "Optional[torch.Tensor | SpilledResidual]" = None
        self.spill: Optional[Callable[[], SpilledResidual]] = None  # set: the residual is kept in a file (``spill_to``)

    def spill_to(self, new_file: Callable[[], SpilledResidual]) -> None:
        """Keep the residual in files ``new_file`` makes from now on (the one held now moves there)."""
        self.spill = new_file
        if isinstance(self._residual, torch.Tensor):
            self.install(self._residual)

    @property
    def residual(self) -> torch.Tensor:
        """What the codec dropped so far (zeros made on request while it is zero: they are not kept; read from its file
        into a new vector when it is kept in one)."""
        if isinstance(self._residual, SpilledResidual):
            return self._residual.tensor()
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

    def compensate(self, delta: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
        """Δ + β·residual (a new tensor, or Δ itself while the residual is zero). ``in_place``: written into Δ's own
        memory (its caller reads Δ no more), a piece at a time: no vector is made beside Δ and the residual."""
        self._check(delta, "the pseudo-gradient")
        residual = self._residual
        if residual is None:
            return delta
        spilled = isinstance(residual, SpilledResidual)
        if not in_place:
            if not spilled:
                return delta + residual if self.decay == 1.0 else delta + self.decay * residual
            delta = delta.clone()
        buffer = torch.empty(min(PIECE, self._numel), dtype=torch.float32) if spilled else None
        for start in range(0, self._numel, PIECE):  # the same fp32 products and sums as above
            part, end = delta[start : start + PIECE], min(start + PIECE, self._numel)
            piece = residual.read(start, buffer[: end - start]) if spilled else residual[start:end]
            part.add_(piece if self.decay == 1.0 else self.decay * piece)
        return delta

    def update(self, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remember what the codec lost: ``sent_input − decoded``."""
        self._check(sent_input, "the sent vector")
        self._check(decoded, "the decoded vector")
        self.install(sent_input - decoded)

    def install(self, residual: "torch.Tensor | SpilledResidual") -> None:
        """``residual`` (what the codec dropped of the sent vector, ``DroppedInPlace``) is the residual now; a vector
        goes to a file of its own when the residual is kept in files."""
        if isinstance(residual, SpilledResidual):
            if residual.numel != self._numel:
                raise ValueError(f"error feedback holds {self.numel} elements; the residual file has {residual.numel}.")
            self._set(residual if residual.nonzero else None)
            if not residual.nonzero:
                residual.delete()
            return
        self._check(residual, "the residual")
        if not bool(residual.any()):
            self._set(None)
        elif self.spill is not None:
            kept = self.spill()
            kept.write(0, residual)
            self._set(kept)
        else:
            self._set(residual)

    def _set(self, residual: "Optional[torch.Tensor | SpilledResidual]") -> None:
        old, self._residual = self._residual, residual
        if isinstance(old, SpilledResidual) and old is not residual:
            old.delete()

    def reset(self) -> None:
        self._set(None)
