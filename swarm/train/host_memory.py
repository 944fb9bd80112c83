"""Giving freed host memory back to the operating system between the phases of a round.

glibc keeps the memory of freed blocks under its mmap threshold (32 MiB at most) in its heaps: a real model's
gradients, activations and the optimizer's temporaries, freed after the inner steps, stay in the process's
resident memory while the exchange then allocates its own model-sized buffers beside them (a 124M-parameter
peer: about 1 GB that nothing used). ``malloc_trim`` hands it back; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> None:
    """Return the C heap's free memory to the system (a few ms; a no-op where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
