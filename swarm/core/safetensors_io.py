"""safetensors, written and read without a copy of the whole state: a file's layout as views of the tensors'
memory, lazy tensors made only when written, and a checked reader over a buffer or a private mapping."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
import torch

# The format is safetensors' (https://github.com/huggingface/safetensors): a little-endian u64 header length,
# a JSON header padded with spaces to a multiple of 8, then the tensors' bytes back to back. safetensors'
# ``load``/``load_file`` read what is written here; what is read here is checked as strictly as they do.

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_HEADER_SIZE = struct.Struct("<Q")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
IO_BLOCK = 8 << 20  # bytes hashed and written at a time


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made only when its bytes are written (``make()``, once): a vote of a tentative state is written
    one stepped tensor at a time, never as a second whole state. Its dtype and shape are known before."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor: a flat view of its memory (no copy; it keeps the tensor alive)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("only a contiguous CPU tensor's bytes can be viewed")
    flat = t.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class SafetensorsLayout:
    """A safetensors file of ``tensors`` as parts: its header's bytes, then each tensor's bytes (a view of a CPU
    tensor's memory; another device's tensor is copied to the CPU when its bytes are wanted, one at a time).
    Tensors go in order of decreasing element size, then name (so each one is aligned to its element size),
    which for one dtype is safetensors' own order; the metadata keys in the order given."""

    def __init__(self, tensors: dict[str, torch.Tensor | LazyTensor], metadata: dict[str, str] | None = None):
        for name, t in tensors.items():
            if t.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name} is {t.dtype}, which safetensors does not store")
        named = sorted(
            ((name, t if isinstance(t, LazyTensor) else t.detach()) for name, t in tensors.items()),
            key=lambda item: (-item[1].element_size(), item[0]),
        )
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self.header = _HEADER_SIZE.pack(len(text)) + text
        self._tensors = [t for _, t in named]
        self.names = [name for name, _ in named]  # in the order of their bytes
        # a CPU tensor's view is made once (a committed state is served from these for as long as it is published)
        self._views: list[Optional[memoryview]] = [memoryview(self.header)] + [
            None if isinstance(t, LazyTensor) or t.device.type != "cpu" else tensor_bytes(t.contiguous())
            for t in self._tensors
        ]
        self.starts: list[int] = []
        position = 0
        for size in [len(self.header)] + [t.numel() * t.element_size() for t in self._tensors]:
            self.starts.append(position)
            position += size
        self.size = position

    def part(self, index: int) -> memoryview:
        """Part ``index``'s bytes: 0 the header, i the i-th tensor's (a lazy one's made now)."""
        view = self._views[index]
        if view is not None:
            return view
        t = self._tensors[index - 1]
        if isinstance(t, LazyTensor):
            made = t.make()
            if made.dtype != t.dtype or tuple(made.shape) != tuple(t.shape):
                raise ValueError(
                    f"a lazy tensor declared {t.dtype} {tuple(t.shape)} and made {made.dtype} {tuple(made.shape)}"
                )
            t = made
        return tensor_bytes(t.detach().cpu().contiguous())

    def read(self, offset: int, length: int | None = None) -> bytes:
        """``length`` bytes (None: to the end) from ``offset``, fewer at the end: one copy of those bytes only."""
        pieces = self._pieces(offset, length)
        return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)

    def view(self, offset: int, length: int) -> memoryview | bytes:
        """Like ``read``, but a view (no copy) where the range lies in one part."""
        pieces = self._pieces(offset, length)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _pieces(self, offset: int, length: int | None) -> list[memoryview]:
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"offset {offset} or length {length} is negative")
        stop = self.size if length is None else min(self.size, offset + length)
        pieces = []
        index = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while offset < stop and index < len(self.starts):
            start = self.starts[index]
            piece = self.part(index)[offset - start : stop - start]
            if piece.nbytes:
                pieces.append(piece)
                offset += piece.nbytes
            index += 1
        return pieces

    def blocks(self, block: int = IO_BLOCK) -> Iterator[memoryview]:
        """Every byte of the file, in order, as views of at most ``block`` bytes."""
        for index in range(len(self.starts)):
            part = self.part(index)
            for start in range(0, part.nbytes, block):
                yield part[start : start + block]


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_header(text: bytes, data_bytes: int) -> tuple[list[_Entry], dict[str, str]]:
    """The entries of a safetensors header (in the order of their bytes) and its metadata; ValueError unless
    they describe exactly ``data_bytes`` bytes, tensor after tensor, each of its dtype's and shape's size."""

    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("the header names a tensor twice")
        return dict(pairs)

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its metadata is not a map of strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r} is described by {info!r}")
        dtype, shape, offsets = _TORCH_DTYPES.get(info["dtype"]), info["shape"], info["data_offsets"]
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {info['dtype']!r}")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
        ):
            raise ValueError(f"tensor {name!r} has shape {shape!r} and offsets {offsets!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"tensor {name!r} of shape {shape} takes {nbytes} bytes, not the offsets {offsets}")
        entries.append(_Entry(name, dtype, tuple(shape), offsets[0], offsets[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    position = 0
    for e in entries:
        if e.begin != position:
            raise ValueError(f"tensor {e.name!r} starts at {e.begin}, not at {position} (a gap or an overlap)")
        position = e.end
    if position != data_bytes:
        raise ValueError(f"its tensors take {position} bytes and it holds {data_bytes}")
    return entries, metadata


def _header_length(prefix: bytes | memoryview, total: int) -> int:
    if len(prefix) < _HEADER_SIZE.size:
        raise ValueError(f"{total} bytes are too few for a header")
    (n,) = _HEADER_SIZE.unpack(prefix[: _HEADER_SIZE.size])
    if n > MAX_HEADER_BYTES or _HEADER_SIZE.size + n > total:
        raise ValueError(f"a header of {n} bytes does not fit in {total} bytes")
    return n


def tensors_from_buffer(
    buffer: bytes | bytearray | memoryview | np.ndarray,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the safetensors bytes in ``buffer``. A writable buffer's tensors are views of it
    (each one keeps it alive; one that would be misaligned is copied); a read-only one's are copies."""
    view = (
        memoryview(buffer).cast("B")
        if not isinstance(buffer, np.ndarray)
        else memoryview(buffer.reshape(-1).view(np.uint8))
    )
    n = _header_length(view, view.nbytes)
    base = _HEADER_SIZE.size + n
    entries, metadata = _parse_header(bytes(view[_HEADER_SIZE.size : base]), view.nbytes - base)
    array = np.frombuffer(view, dtype=np.uint8)
    tensors = {}
    for e in entries:
        raw = array[base + e.begin : base + e.end]
        if view.readonly or raw.ctypes.data % e.dtype.itemsize:
            raw = raw.copy()
        tensors[e.name] = torch.from_numpy(raw).view(e.dtype).reshape(e.shape)
    return tensors, metadata


def write_safetensors(
    f: BinaryIO,
    tensors: dict[str, torch.Tensor | LazyTensor],
    metadata: dict[str, str] | None = None,
    *,
    digest: bool = True,
) -> tuple[str | None, int]:
    """Write ``tensors`` to the open (binary, unbuffered) file ``f`` as safetensors, straight from their memory
    (another device's tensors are copied to the CPU one at a time); returns (the SHA-256 of what was written, its size),
    computed in the same pass (None for the digest with ``digest=False``)."""
    layout = SafetensorsLayout(tensors, metadata)
    hasher = hashlib.sha256() if digest else None
    for block in layout.blocks():
        if hasher is not None:
            hasher.update(block)  # hashlib and the write release the GIL: the trainer's threads go on meanwhile
        while block.nbytes:
            written = f.write(block)
            block = block[written:]
    return (hasher.hexdigest() if hasher is not None else None), layout.size


def write_parts(f: BinaryIO, layout: SafetensorsLayout, indices: list[int]) -> None:
    """Write ``layout``'s parts ``indices`` (0: the header, i: the i-th tensor) at their offsets in the open file
    ``f``, straight from their memory: a file written in two goes, the rest of it before or after (a checkpoint's
    tensors that change soon at once, those that stay put later, peer/state/checkpoint.py)."""
    fd = f.fileno()
    for index in indices:
        part, offset = layout.part(index), layout.starts[index]
        for start in range(0, part.nbytes, IO_BLOCK):
            block = part[start : start + IO_BLOCK]
            position = offset + start
            while block.nbytes:
                written = os.pwrite(fd, block, position)
                block, position = block[written:], position + written


def map_safetensors(path: Path | str, *, digest: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """(tensors, metadata, SHA-256 of the file) of a safetensors file, mapped rather than read: one pass over
    its bytes (the hash), and the tensors are views of a private copy-on-write mapping (writable; a write
    copies only the page it touches, never the file). ValueError for malformed bytes; the caller compares the
    hash before it trusts the tensors. ``digest=False``: no pass and "" for the hash, for tensors the caller
    checks by a hash of its own (a vote's state hash)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEADER_SIZE.size:
            raise ValueError(f"{size} bytes are too few for a header")
        mapped = mmap.mmap(
            f.fileno(),
            size,
            flags=mmap.MAP_PRIVATE,  # no MAP_POPULATE: it would copy every page
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    sha256 = hashlib.sha256(mapped).hexdigest() if digest else ""  # releases the GIL: a vote written meanwhile goes on
    tensors, metadata = tensors_from_buffer(mapped)  # each tensor keeps the mapping alive
    return tensors, metadata, sha256
