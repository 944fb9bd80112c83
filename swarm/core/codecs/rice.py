"""Rice codes for the positions of a sparse vector: an entropy code of the gaps between sent elements,
near the entropy of the positions when they are spread like independent draws (geometric gaps), in
integer numpy operations only, so a sender gets the same bytes on every machine.

A gap g (zeros skipped before a sent element) with parameter r is ``g >> r`` in unary (that many 1 bits,
then a 0 bit) and ``g``'s low r bits; each code carries one more bit of the caller's (a sign). Layout:
one byte r, then the fixed-width parts (r low bits, most significant first, then the extra bit, per
code), then the unary parts; each of the two streams packed LSB first and padded with 0 bits to a byte.
Two streams instead of one interleaved code: the same number of bits, and both decode without a loop.
"""

from __future__ import annotations

import numpy as np

MAX_PARAMETER = 24  # gaps below 2²⁴ × the unary length: far more than any slice holds


def _stream_bytes(unary_bits: int, count: int, r: int) -> int:
    return -(-count * (r + 1) // 8) + -(-unary_bits // 8)


def encode(gaps: np.ndarray, extra: np.ndarray) -> bytes:
    """The bytes of ``gaps`` (non-negative integers) with one ``extra`` bit (0 or 1) per gap, with the
    parameter r that makes them shortest (the smallest such r)."""
    gaps = np.asarray(gaps, dtype=np.int64)
    count = gaps.size
    if count == 0:
        return b""
    best, best_size = 0, None
    for r in range(MAX_PARAMETER + 1):
        size = _stream_bytes(int((gaps >> r).sum()) + count, count, r)
        if best_size is None or size < best_size:
            best, best_size = r, size
    r = best
    fixed = np.empty((count, r + 1), dtype=np.uint8)
    for j in range(r):
        fixed[:, j] = (gaps >> (r - 1 - j)) & 1
    fixed[:, r] = np.asarray(extra, dtype=np.uint8)
    quotients = gaps >> r
    unary = np.ones(int(quotients.sum()) + count, dtype=np.uint8)
    unary[np.cumsum(quotients + 1) - 1] = 0  # each code's terminating 0
    return (
        bytes([r])
        + np.packbits(fixed.reshape(-1), bitorder="little").tobytes()
        + np.packbits(unary, bitorder="little").tobytes()
    )


def decode(data: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(gaps, extra bits) of ``count`` codes that ``encode`` wrote as exactly ``data``; ValueError when
    ``data`` is not such a payload (too short or long, a parameter or padding encode never writes)."""
    if count == 0:
        if data:
            raise ValueError("rice: a payload of no codes must be empty.")
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    if not data or data[0] > MAX_PARAMETER:
        raise ValueError("rice: the payload is empty or its parameter is out of range.")
    r = data[0]
    fixed_bytes = -(-count * (r + 1) // 8)
    if len(data) < 1 + fixed_bytes:
        raise ValueError("rice: the payload is shorter than its fixed-width codes.")
    raw = np.frombuffer(data, dtype=np.uint8, offset=1)
    fixed = np.unpackbits(raw[:fixed_bytes], bitorder="little")
    if fixed[count * (r + 1) :].any():
        raise ValueError("rice: the padding after the fixed-width codes is not zero.")
    fixed = fixed[: count * (r + 1)].reshape(count, r + 1).astype(np.int64)
    unary = np.unpackbits(raw[fixed_bytes:], bitorder="little")
    ends = np.flatnonzero(unary == 0)
    if ends.size < count:
        raise ValueError("rice: the payload ends before its last code.")
    used = int(ends[count - 1]) + 1
    if -(-used // 8) * 8 != unary.size or unary[used:].any():
        raise ValueError("rice: the payload does not end right after its last code.")
    quotients = np.diff(ends[:count], prepend=-1) - 1
    low = np.zeros(count, dtype=np.int64)
    for j in range(r):
        low = (low << 1) | fixed[:, j]
    return (quotients << r) | low, fixed[:, r].astype(np.uint8)


def max_size(count: int, span: int) -> int:
    """The most bytes ``encode`` returns for ``count`` gaps summing to at most ``span − count``: r = 0's
    size (one bit per skipped element plus two per code), which the chosen r never exceeds."""
    return 0 if count == 0 else 1 + -(-count // 8) + -(-span // 8)
