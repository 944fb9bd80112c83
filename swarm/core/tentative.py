"""A round's tentative global state, held as what makes it rather than as its tensors: the committed state,
the averaged Δ̄ over the round's spans and the Nesterov outer step. Its hash and its vote on disk are made
one tensor at a time, and a commit steps the committed tensors in place, so a round never holds a second
θg and outer state (two model-sized copies at any model size).

Each tensor it yields is what ``spans.tentative_step`` gives for it, computed by the same fp32 ops on the
same inputs (``outer_step`` is elementwise: a tensor stepped alone has the bits it has stepped with the
others), so its hash is the materialised state's, and a commit installs exactly the bits that were voted on.
Only the Nesterov outer optimizer is stepped this way; the trainer materialises a ``torch.optim`` one's step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import struct
from typing import BinaryIO, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from swarm.core.average import _f32, as_cpu_f32
from swarm.core.outer import OuterOptimizer
from swarm.core.safetensors_io import IO_BLOCK, LazyTensor, SafetensorsLayout, tensor_bytes
from swarm.core.spans import Span
from swarm.core.state import GlobalState


class TentativeState:
    """The state ``base`` would become after the outer step of ``spans`` with ``deltas`` (one tensor per span,
    shaped as ``spans.gather`` gives them). ``base``'s tensors must not change until this is committed or
    dropped; nothing here changes them before ``commit_in_place``."""

    CHUNK = 1 << 20  # elements stepped at a time: every op in reused buffers of 4 MB, none on fresh pages

    def __init__(
        self,
        round_no: int,
        base: GlobalState,
        outer: OuterOptimizer,
        deltas: Sequence[torch.Tensor],
        spans: Sequence[Span],
    ) -> None:
        if outer.name != "nesterov":
            raise ValueError(
                f"a tentative state is stepped lazily only with the nesterov outer optimizer, not {outer.name}."
            )
        if len(deltas) != len(spans):
            raise ValueError(f"got {len(deltas)} averaged deltas for {len(spans)} spans.")
        self.round_no = round_no
        self.base = base
        self.committed: GlobalState | None = None  # once committed: the state it became (base's tensors, stepped)
        cfg = outer.config
        self._lr, self._mu, self._nesterov = _f32(cfg.lr), _f32(cfg.momentum), cfg.nesterov
        self._by_param: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # (start, stop, Δ̄ flat) per parameter
        for s, d in zip(spans, deltas):
            self._by_param.setdefault(s.param, []).append((s.start, s.stop, d.reshape(-1)))
        for parts in self._by_param.values():
            parts.sort(key=lambda part: part[0])
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._pending: list[Optional[concurrent.futures.Future]] = [None, None]  # each slot's hash being made
        self._slot = 1  # the scratch pair of outputs ``_both`` stepped into last (0: buffers 0, 1; 1: buffers 3, 4)

    # ---- one piece at a time ----------------------------------------------------------------------------
    def _buffer(self, n: int, which: int) -> torch.Tensor:
        """The first ``n`` elements of reused scratch buffer ``which`` (0, 1, 2; 3 and 4: a second pair of outputs,
        for a writer whose hash of the previous piece is still running)."""
        if self._scratch.numel() < max(3, which + 1) * self.CHUNK:
            self._scratch = torch.empty(max(3, which + 1) * self.CHUNK, dtype=torch.float32)
        return self._scratch[which * self.CHUNK : which * self.CHUNK + n]

    def _step_into(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, out_p: torch.Tensor, out_m: torch.Tensor
    ) -> None:
        """``outer_step`` of one piece, written into ``out_p`` and ``out_m``, by the same fp32 ops in the same
        order, one rounding each: m' = (m·μ) + g; u = g + (m'·μ) (Nesterov) or m'; p' = p − (u·lr). ``out_m``
        may be ``m`` itself and ``out_p`` ``p`` itself (each element reads only itself)."""
        torch.mul(m, self._mu, out=out_m)
        out_m.add_(g)
        u = self._buffer(p.numel(), 2)
        if self._nesterov:
            torch.mul(out_m, self._mu, out=u)
            u.add_(g)  # x + g: the same bits as g + x
        else:
            u.copy_(out_m)
        u.mul_(self._lr)
        torch.sub(p, u, out=out_p)

    def _segments(self, group: int, i: int) -> Iterator[torch.Tensor]:
        """Tensor ``i`` of ``group`` (0: θg', 1: the outer state) as consecutive 1-D pieces of its values: the
        committed tensor's own memory where the round leaves it, else a scratch buffer that the next piece
        overwrites (read each piece before asking for the next)."""
        p_flat = as_cpu_f32(self.base.params[i]).reshape(-1)
        m_flat = self.base.outer_state[i].reshape(-1)
        base = p_flat if group == 0 else m_flat
        at = 0
        for start, stop, d in self._by_param.get(i, []):
            if at < start:
                yield base[at:start]
            for lo in range(start, stop, self.CHUNK):
                hi = min(stop, lo + self.CHUNK)
                out_p, out_m = self._buffer(hi - lo, 0), self._buffer(hi - lo, 1)
                self._step_into(p_flat[lo:hi], d[lo - start : hi - start], m_flat[lo:hi], out_p, out_m)
                yield out_p if group == 0 else out_m
            at = stop
        if at < base.numel():
            yield base[at:]

    def tensor(self, group: int, i: int) -> torch.Tensor:
        """Tensor ``i`` of θg' (``group`` 0) or of the outer state (1), whole and shaped (a new tensor when
        the round changes it, else the committed one)."""
        if self.committed is not None:
            return (self.committed.params if group == 0 else self.committed.outer_state)[i]
        base = (self.base.params if group == 0 else self.base.outer_state)[i]
        if i not in self._by_param:
            return base
        out = torch.empty(base.shape, dtype=torch.float32)
        flat, at = out.view(-1), 0
        for piece in self._segments(group, i):
            flat[at : at + piece.numel()].copy_(piece)
            at += piece.numel()
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the state's one layout (``swarm.core.state.state_tensors``), made one at a time."""
        for i in range(len(self.base.params)):
            yield f"param.{i:05d}", self.tensor(0, i)
        for i in range(len(self.base.outer_state)):
            yield f"outer.{i:05d}", self.tensor(1, i)

    @functools.cached_property
    def state_hash(self) -> str:
        """``swarm.core.state.state_hash`` of the tentative state, one tensor's pieces at a time."""
        h = hashlib.sha256()
        for group, tensors in enumerate((self.base.params, self.base.outer_state)):
            h.update(struct.pack("<q", len(tensors)))
            for i, t in enumerate(tensors):
                h.update(struct.pack("<q", t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
                for piece in self._segments(group, i):
                    arr = piece.contiguous().numpy().astype("<f4", copy=False)
                    h.update(arr.view(np.uint8).data)
        return h.hexdigest()[:16]

    def _both(
        self, i: int, before_step: Callable[[int], None] = lambda slot: None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """Tensor ``i``'s θg' and outer-state values together, as consecutive 1-D pieces of equal length, each with
        its scratch slot (-1: the committed tensors' own memory): each stepped piece is stepped once for both, into
        slot 0 and 1 in turn, which the next piece but one overwrites (``before_step(slot)`` is called first)."""
        p_flat = as_cpu_f32(self.base.params[i]).reshape(-1)
        m_flat = self.base.outer_state[i].reshape(-1)
        at = 0
        for start, stop, d in self._by_param.get(i, []):
            if at < start:
                yield p_flat[at:start], m_flat[at:start], -1
            for lo in range(start, stop, self.CHUNK):
                hi = min(stop, lo + self.CHUNK)
                self._slot ^= 1
                before_step(self._slot)
                out_p, out_m = self._buffer(hi - lo, 3 * self._slot), self._buffer(hi - lo, 3 * self._slot + 1)
                self._step_into(p_flat[lo:hi], d[lo - start : hi - start], m_flat[lo:hi], out_p, out_m)
                yield out_p, out_m, self._slot
            at = stop
        if at < p_flat.numel():
            yield p_flat[at:], m_flat[at:], -1

    def write_safetensors(self, f: BinaryIO, metadata: Optional[dict[str, str]] = None) -> int:
        """The state in its one layout (``swarm.core.state.state_tensors``) written to the open binary file ``f``
        (readable too) as safetensors, in one stepping pass: each piece is stepped once and its θg' and outer-state
        bytes written where they go in the file. The hash (``state_hash``), when not known yet, is made meanwhile on
        a thread of its own, in the order it takes the bytes: θg' from the pieces as they are stepped (a scratch
        slot is stepped into again only once its hash is made), then the outer state read back from what was
        written. SHA-256 is one sequential stream, the slowest part: the stepping and writing run beside it on the
        other core. Returns the file's size (the file is cut there). The same bytes as ``write_safetensors`` of
        the materialised state."""
        n = len(self.base.params)
        if len(self.base.outer_state) != n:
            raise ValueError("a nesterov state holds one momentum tensor per parameter.")
        lazy = {
            f"{prefix}.{i:05d}": LazyTensor(torch.float32, tuple(t.shape), lambda: None)
            for prefix, group in (("param", self.base.params), ("outer", self.base.outer_state))
            for i, t in enumerate(group)
        }
        layout = SafetensorsLayout(lazy, metadata)
        at = dict(zip(layout.names, layout.starts[1:]))
        fd = f.fileno()
        _pwrite_all(fd, memoryview(layout.header), 0)
        if "state_hash" in self.__dict__ or self.committed is not None:
            for i in range(n):
                self._write_pieces(fd, i, at[f"param.{i:05d}"], at[f"outer.{i:05d}"], None)
            os.ftruncate(fd, layout.size)
            return layout.size
        h = hashlib.sha256()
        self._buffer(0, 4)  # both pairs of outputs at once: no buffer is replaced while its hash is pending
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vote-hash") as hashing:

            def hashed(data: bytes | memoryview) -> concurrent.futures.Future:  # in the order submitted
                return hashing.submit(h.update, data)

            try:
                hashed(struct.pack("<q", n))
                for i, t in enumerate(self.base.params):
                    hashed(struct.pack("<q", t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
                    self._write_pieces(fd, i, at[f"param.{i:05d}"], at[f"outer.{i:05d}"], hashed)
                hashed(struct.pack("<q", n))
                outer = [(t, at[f"outer.{i:05d}"]) for i, t in enumerate(self.base.outer_state)]
                hashing.submit(_hash_read_back, h, fd, outer).result()
            finally:
                self._pending = [None, None]
        os.ftruncate(fd, layout.size)  # a file written over (a vote's recycled file) may have been longer
        self.__dict__["state_hash"] = h.hexdigest()[:16]  # cached_property's slot: the bits just written
        return layout.size

    def _write_pieces(
        self, fd: int, i: int, p_at: int, m_at: int, hashed: Optional[Callable[[memoryview], concurrent.futures.Future]]
    ) -> None:
        """Tensor ``i``'s θg' and outer-state pieces written at ``p_at`` and ``m_at``; θg''s bytes handed to
        ``hashed`` (None: not hashed), a slot's pending hash waited for before the slot is stepped into again."""

        def free(slot: int) -> None:
            pending = self._pending[slot]
            if pending is not None:
                pending.result()
                self._pending[slot] = None

        for p, m, slot in self._both(i, free):
            p_bytes, m_bytes = tensor_bytes(p), tensor_bytes(m)
            if hashed is not None:
                future = hashed(p_bytes)
                if slot >= 0:
                    self._pending[slot] = future
            _pwrite_all(fd, p_bytes, p_at)
            _pwrite_all(fd, m_bytes, m_at)
            p_at, m_at = p_at + p_bytes.nbytes, m_at + m_bytes.nbytes

    # ---- the whole state, when a caller needs it -----------------------------------------------------
    @property
    def params(self) -> list[torch.Tensor]:
        return [self.tensor(0, i) for i in range(len(self.base.params))]

    @property
    def outer_state(self) -> list[torch.Tensor]:
        return [self.tensor(1, i) for i in range(len(self.base.outer_state))]

    @torch.no_grad()
    def commit_in_place(self, copy_into: Optional[Sequence[torch.Tensor]] = None) -> GlobalState:
        """Step ``base``'s tensors in place and return them as the state of this round (its hash is this
        one's: the same ops on the same inputs). ``base`` itself must not be used afterwards; this object's
        tensors are then the committed ones. ``copy_into`` (contiguous fp32 CPU tensors shaped as the parameters,
        θl): each stepped piece is also copied there while it is in cache, for a commit that replaces θl's
        spans of the round with θg's."""
        if self.committed is not None:
            return self.committed
        self.state_hash  # noqa: B018  both hashed before the base's bits change (the base's is cached already
        self.base.state_hash  # noqa: B018  whenever it was installed or committed: no second pass over it)
        params, outer = self.base.params, self.base.outer_state
        for i, parts in self._by_param.items():
            p_flat, m_flat = params[i].view(-1), outer[i].view(-1)
            for start, stop, d in parts:
                for lo in range(start, stop, self.CHUNK):
                    hi = min(stop, lo + self.CHUNK)
                    p, m = p_flat[lo:hi], m_flat[lo:hi]
                    self._step_into(p, d[lo - start : hi - start], m, p, m)
                    if copy_into is not None:
                        copy_into[i].view(-1)[lo:hi].copy_(p)
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._by_param = {}  # Δ̄ is applied: its model-sized memory goes back as soon as the exchange lets go of it
        state = GlobalState(self.round_no, params, outer)
        state.__dict__["state_hash"] = self.state_hash  # cached_property's slot: the bits it hashed are these
        self.committed = state
        return state


def _hash_read_back(h: "hashlib._Hash", fd: int, tensors: Sequence[tuple[torch.Tensor, int]]) -> None:
    """The hash of each tensor's shape and bytes, the bytes read back from ``fd`` at its offset."""
    buffer = bytearray(IO_BLOCK)
    for t, start in tensors:
        h.update(struct.pack("<q", t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
        stop = start + 4 * t.numel()
        for lo in range(start, stop, IO_BLOCK):
            want = min(IO_BLOCK, stop - lo)
            got = os.preadv(fd, [memoryview(buffer)[:want]], lo)
            if got != want:
                raise OSError(f"read back {got} of {want} bytes of the vote just written")
            h.update(memoryview(buffer)[:got])


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
