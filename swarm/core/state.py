"""The global state: θg and the outer optimizer's state, and the hash that says two peers hold the same
bits."""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from swarm.core.average import as_cpu_f32


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
