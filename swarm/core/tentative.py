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

import functools
import hashlib
import struct
from typing import Iterator, Sequence

import numpy as np
import torch

from swarm.core.average import as_cpu_f32
from swarm.core.outer import OuterOptimizer, outer_step
from swarm.core.spans import Span, is_whole
from swarm.core.state import GlobalState


class TentativeState:
    """The state ``base`` would become after the outer step of ``spans`` with ``deltas`` (one tensor per span,
    shaped as ``spans.gather`` gives them). ``base``'s tensors must not change until this is committed or
    dropped; nothing here changes them before ``commit_in_place``."""

    def __init__(self, round_no: int, base: GlobalState, outer: OuterOptimizer, deltas: Sequence[torch.Tensor],
                 spans: Sequence[Span]) -> None:
        if outer.name != "nesterov":
            raise ValueError(f"a tentative state is stepped lazily only with the nesterov outer optimizer, not {outer.name}.")
        if len(deltas) != len(spans):
            raise ValueError(f"got {len(deltas)} averaged deltas for {len(spans)} spans.")
        self.round_no = round_no
        self.base = base
        self.committed: GlobalState | None = None  # once committed: the state it became (base's tensors, stepped)
        cfg = outer.config
        self._step = functools.partial(outer_step, lr=cfg.lr, momentum_coef=cfg.momentum, nesterov=cfg.nesterov)
        self._by_param: dict[int, list[tuple[Span, torch.Tensor]]] = {}
        for s, d in zip(spans, deltas):
            self._by_param.setdefault(s.param, []).append((s, d))

    # ---- one tensor at a time -------------------------------------------------------------------------
    def _stepped(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(θg'_i, m'_i): new tensors for a parameter the round steps whole; for one it steps in parts, the
        stepped parts only (see ``_segments``)."""
        (s, d), = self._by_param[i]
        p, m = self._step([as_cpu_f32(self.base.params[i])], [d], [self.base.outer_state[i]])
        return p[0], m[0]

    def _part(self, i: int, s: Span, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = as_cpu_f32(self.base.params[i]).reshape(-1)[s.start:s.stop]
        m = self.base.outer_state[i].reshape(-1)[s.start:s.stop]
        stepped, momentum = self._step([p], [d], [m])
        return stepped[0], momentum[0]

    def _whole(self, i: int) -> bool:
        parts = self._by_param.get(i)
        return parts is not None and len(parts) == 1 and is_whole(parts[0][0], self.base.params[i])

    def _segments(self, group: int, i: int) -> Iterator[torch.Tensor]:
        """Tensor ``i`` of ``group`` (0: θg, 1: the outer state) as consecutive 1-D pieces of its values."""
        base = (self.base.params if group == 0 else self.base.outer_state)[i]
        parts = self._by_param.get(i)
        if parts is None:
            yield as_cpu_f32(base).reshape(-1)
            return
        if self._whole(i):
            yield self._stepped(i)[group].reshape(-1)
            return
        flat, at = as_cpu_f32(base).reshape(-1), 0
        for s, d in sorted(parts, key=lambda sd: sd[0].start):
            if at < s.start:
                yield flat[at:s.start]
            yield self._part(i, s, d)[group]
            at = s.stop
        if at < flat.numel():
            yield flat[at:]

    def tensor(self, group: int, i: int) -> torch.Tensor:
        """Tensor ``i`` of θg' (``group`` 0) or of the outer state (1), whole and shaped (a new tensor when
        the round changes it, else the committed one)."""
        if self.committed is not None:
            return (self.committed.params if group == 0 else self.committed.outer_state)[i]
        base = (self.base.params if group == 0 else self.base.outer_state)[i]
        if i not in self._by_param:
            return base
        if self._whole(i):
            return self._stepped(i)[group].view(base.shape)
        return torch.cat(list(self._segments(group, i))).view(base.shape)

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

    # ---- the whole state, when a caller needs it -----------------------------------------------------
    @property
    def params(self) -> list[torch.Tensor]:
        return [self.tensor(0, i) for i in range(len(self.base.params))]

    @property
    def outer_state(self) -> list[torch.Tensor]:
        return [self.tensor(1, i) for i in range(len(self.base.outer_state))]

    @torch.no_grad()
    def commit_in_place(self) -> GlobalState:
        """Step ``base``'s tensors in place and return them as the state of this round (its hash is this
        one's: the same ops on the same inputs). ``base`` itself must not be used afterwards; this object's
        tensors are then the committed ones."""
        if self.committed is not None:
            return self.committed
        self.state_hash  # noqa: B018  both hashed before the base's bits change (the base's is cached already
        self.base.state_hash  # noqa: B018  whenever it was installed or committed: no second pass over it)
        params, outer = self.base.params, self.base.outer_state
        for i, parts in self._by_param.items():
            if self._whole(i):
                p, m = self._stepped(i)
                params[i].copy_(p.view(params[i].shape))
                outer[i].copy_(m.view(outer[i].shape))
                continue
            # parts: each reads only its own elements, so stepping them one after another in place is the same
            for s, d in parts:
                p, m = self._part(i, s, d)
                params[i].view(-1)[s.start:s.stop].copy_(p)
                outer[i].view(-1)[s.start:s.stop].copy_(m)
        state = GlobalState(self.round_no, params, outer)
        state.__dict__["state_hash"] = self.state_hash  # cached_property's slot: the bits it hashed are these
        self.committed = state
        return state
