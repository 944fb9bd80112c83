"""The global state: θg and the outer optimizer's state, and the hash that says two peers hold the same
bits."""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np
import torch

from swarm.core.average import as_cpu_f32


def state_hash(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> str:
    """First 16 hex chars of sha256 over the shapes and little-endian fp32 bytes of params, then
    momentum: equal hashes mean bit-identical global state."""
    h = hashlib.sha256()
    for group in (params, momentum):
        h.update(struct.pack("<q", len(group)))
        for t in group:
            arr = as_cpu_f32(t).contiguous().numpy().astype("<f4", copy=False)
            h.update(struct.pack("<q", arr.ndim) + struct.pack(f"<{arr.ndim}q", *arr.shape))
            h.update(arr.reshape(-1).view(np.uint8).data)  # no copy: the state may be GBs
    return h.hexdigest()[:16]
