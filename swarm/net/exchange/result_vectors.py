"""The vectors an exchange writes its result into, handed out again once nothing holds them; and, in a second
pool, the slices it decodes its groupmates' contributions into and reduces them into.

Why: the result of an exchange is model-sized, and memory fresh from the kernel costs a fault and a zeroed page
on its first touch. On this project's test machine (a VM) decoding into a fresh 100 MB result took 26 ms, and
320 ms when the VM had not backed the pages yet, against 16 ms into a reused one; across a 4-peer 1 Gbit/s int4
exchange, reusing it cuts the hosts' CPU by about 30%, and reusing the decoded contributions and the reductions
by another 14% (memory freed on the threads that decode is handed back to the kernel by glibc, so without the pool
it faults again every exchange).

When a vector is free: the pool keeps the numpy array that owns the memory, and everything that shares that
memory holds a reference to that array — the result tensor's storage, every view of it, every ``.numpy()`` of
it. So an array whose only references are the pool's own is read and written by no one, and is handed out again;
one that is still held (a round's vote that keeps its average, an exchange that failed while a decode still
writes into it) is left alone and a fresh one is made. The pool keeps at most ``keep`` arrays: the memory it
holds beyond what its callers hold is at most that many vectors, and between exchanges at most KEEP_MAX_BYTES in all
(``shrink``: a real model's decoded slices are not held through the inner steps).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

KEEP = 1  # one result per exchange at a time (a peer whose rounds overlap gets a fresh one while the last is held)
# Larger vectors are not kept between exchanges: at a real model size a kept result is a model's worth of memory
# held all round for a saving (no page faults on first touch) that is small beside that exchange's bytes.
KEEP_MAX_BYTES = 64 << 20


def _unheld_count() -> int:
    """What ``sys.getrefcount`` says of a list's item that nothing else references, on this interpreter (2 on
    CPython 3.11: the list's reference and the call's argument; an interpreter that does not count the argument
    says 1, and comparing with a constant would then take a vector someone holds for a free one)."""
    probe = [np.empty(0, dtype=np.float32)]
    return sys.getrefcount(probe[0])


UNHELD = _unheld_count()


class ResultVectors:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._arrays: list[np.ndarray] = []
        self.reused = 0  # vectors handed out again (a test's and a benchmark's view of it)

    def take(self, numel: int) -> torch.Tensor:
        """An uninitialised fp32 vector of ``numel`` elements: a kept one nothing holds, else a new one (kept in
        place of the oldest). Its caller writes every element before anyone reads it."""
        for i in range(len(self._arrays)):
            # only the list's reference (and the call's own): nothing else shares the memory
            if self._arrays[i].size == numel and sys.getrefcount(self._arrays[i]) == UNHELD:
                self.reused += 1
                return torch.from_numpy(self._arrays[i])
        array = np.empty(numel, dtype=np.float32)  # numpy asks for huge pages for large arrays (average.new_f32)
        if 4 * numel <= KEEP_MAX_BYTES:
            self._arrays = [array, *self._arrays][: self.keep]
        return torch.from_numpy(array)

    def shrink(self) -> None:
        """Between exchanges: the kept vectors go unless they hold at most KEEP_MAX_BYTES together. A real model's
        decoded slices (``keep`` = 2K of them, a quarter of its fp32 bytes) are not held through the inner steps
        that follow, where they would add to training's peak; a small model's stay for the next exchange."""
        if sum(a.nbytes for a in self._arrays) > KEEP_MAX_BYTES:
            self._arrays = []
