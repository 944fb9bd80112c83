"""The global state: θg and the outer optimizer's state, the hash that says two peers hold the same bits,
and its one format on disk and on the wire."""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from swarm.core.average import as_cpu_f32
from swarm.core.safetensors_io import SafetensorsLayout, tensors_from_buffer


def state_hash(params: Sequence[torch.Tensor], outer_state: Sequence[torch.Tensor]) -> str:
    """First 16 hex chars of sha256 over the shapes and little-endian fp32 bytes of params, then
    the outer state: equal hashes mean bit-identical global state."""
    h = hashlib.sha256()
    for group in (params, outer_state):
        h.update(struct.pack("<q", len(group)))
        for t in group:
            arr = as_cpu_f32(t).contiguous().numpy().astype("<f4", copy=False)
            h.update(struct.pack("<q", arr.ndim) + struct.pack(f"<{arr.ndim}q", *arr.shape))
            h.update(arr.reshape(-1).view(np.uint8).data)  # no copy: the state may be GBs
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class GlobalState:
    """θg and the outer optimizer's state after round ``round_no`` (0: the initial state), as fp32 CPU
    tensors in the model's parameter order. The hash is computed from the tensors, once, on first use:
    it is never taken from a sender or a file, so a state always carries the hash of its own bits."""

    round_no: int
    params: list[torch.Tensor]
    outer_state: list[torch.Tensor]

    @functools.cached_property
    def state_hash(self) -> str:
        return state_hash(self.params, self.outer_state)


# ---- the one layout of a global state on disk and on the wire ----------------------------------------
# θg as ``param.00000 …`` and the outer state as ``outer.00000 …`` (fp32, in the model's parameter order).
# Transfers to joiners, checkpoints and votes all use it; a checkpoint adds its own (local.*, inner.*,
# feedback.*) tensors next to these. The final model is the exception: it keeps the model's parameter
# names, so that ``model.load_state_dict`` takes it.


def state_tensors(state: GlobalState) -> dict[str, torch.Tensor]:
    tensors = {f"param.{i:05d}": t.contiguous() for i, t in enumerate(state.params)}
    tensors.update({f"outer.{i:05d}": t.contiguous() for i, t in enumerate(state.outer_state)})
    return tensors


def state_from_tensors(
    tensors: dict[str, torch.Tensor], round_no: int, *, like: Optional[GlobalState], finite: bool = True
) -> GlobalState:
    """The state held in ``tensors`` (other names are ignored), checked against ``like``: the same tensor
    names, shapes and fp32, every value finite. Raises ValueError saying what does not fit. ``like=None``
    (a model not built yet): every ``param.*`` and ``outer.*`` tensor, numbered from 0 without a gap, each fp32;
    the caller checks the shapes against its model. ``finite=False``: the values are not checked, for a caller that
    compares the state's hash with a committed one next (a state the peers committed is the one they all hold)."""
    if like is None:
        counts = [sum(1 for name in tensors if name.startswith(prefix)) for prefix in ("param.", "outer.")]
    else:
        counts = [len(like.params), len(like.outer_state)]
    try:
        params = [tensors[f"param.{i:05d}"] for i in range(counts[0])]
        outer = [tensors[f"outer.{i:05d}"] for i in range(counts[1])]
    except KeyError as e:
        raise ValueError(
            f"the state lacks tensor {e.args[0]}: it is of another model, or of an older Swarm "
            "whose files this version does not read"
        ) from None
    refs = like.params + like.outer_state if like is not None else [None] * len(params + outer)
    for t, ref in zip(params + outer, refs):
        shape, dtype = (ref.shape, ref.dtype) if ref is not None else (t.shape, torch.float32)
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(
                f"a state tensor is {t.dtype} {tuple(t.shape)} where this model has {dtype} "
                f"{tuple(shape)}: the state is of another model"
            )
        if finite and t.numel() and not torch.isfinite(torch.stack(torch.aminmax(t))).all():  # NaN, ±inf: one pass
            raise ValueError("the state holds values that are not finite")
    return GlobalState(round_no, params, outer)


def encode_state(state: GlobalState) -> bytes:
    """The state as one safetensors blob: ``EncodedState(state)``'s bytes joined (small states, tests; a holder
    serves the ``EncodedState`` itself, from views of the tensors)."""
    return EncodedState(state).read(0)


def decode_state(blob: bytes | bytearray | memoryview | np.ndarray, round_no: int, *, like: GlobalState) -> GlobalState:
    """The state in ``blob`` (safetensors), checked against ``like`` (``state_from_tensors``). The tensors of
    a writable buffer (a bytearray, a numpy array: what a download fills) are views of it, not copies, and
    keep it alive; a read-only one (bytes) is copied tensor by tensor."""
    try:
        tensors, _ = tensors_from_buffer(blob)
    except ValueError as e:
        raise ValueError(f"the state is not valid safetensors ({e})") from None
    if len(tensors) != len(like.params) + len(like.outer_state):
        raise ValueError("the state holds a different set of tensors than this model")
    return state_from_tensors(tensors, round_no, like=like)


class EncodedState:
    """``encode_state(state)``'s bytes without making them: the safetensors header, then views of the state's
    own tensors. ``read`` copies only the range asked for. The tensors must not change while it is used:
    ``changed`` tells when one did (an in-place commit of the next round steps them), so that bytes read
    meanwhile are not served as this state's."""

    def __init__(self, state: GlobalState):
        self.round_no, self.state_hash = state.round_no, state.state_hash
        tensors = state_tensors(state)
        self.layout = SafetensorsLayout(tensors, {"round_no": str(state.round_no), "state_hash": state.state_hash})
        self.size = self.layout.size
        self._tensors = list(state.params) + list(state.outer_state)
        self._versions = [_version(t) for t in self._tensors]  # bumped by every in-place op on the tensor

    def changed(self) -> bool:
        """Whether a tensor of the state was modified in place since this was made."""
        return any(_version(t) != v for t, v in zip(self._tensors, self._versions))

    def read(self, offset: int, length: int | None = None) -> bytes:
        return self.layout.read(offset, length)

    def view(self, offset: int, length: int) -> memoryview | bytes:
        return self.layout.view(offset, length)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter (nor can it be modified outside one)
        return -1


def encoded_size_bound(like: GlobalState) -> int:
    """An upper bound on ``len(encode_state(s))`` for a state shaped like ``like`` (its header included):
    a downloader refuses a holder that announces more."""
    tensors = like.params + like.outer_state
    return sum(4 * t.numel() for t in tensors) + 256 * len(tensors) + 4096
