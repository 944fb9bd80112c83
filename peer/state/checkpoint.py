"""A peer's checkpoint on disk: safetensors for tensors, a small JSON manifest for everything else.

Written atomically (a temporary directory, fsync, then one rename), so a crash leaves either the
previous checkpoint or the new one, never half of one (a vote is not fsynced: ``save_checkpoint``'s ``durable``). The manifest records the SHA-256 of the
tensor file, so a truncated or corrupted checkpoint is detected and refused with a clear message
instead of being loaded half. Nothing is pickled.

The tensor file is safetensors (``safetensors.torch.load_file`` reads it), written straight from the tensors'
memory with its SHA-256 computed in the same pass (``swarm.core.safetensors_io.write_safetensors``), and mapped back
(``map_safetensors``): one pass over the file for its hash, and the tensors are views of a private,
copy-on-write mapping. No copy of the whole state is made either way, and the file is not read twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch

from swarm.core.safetensors_io import map_safetensors, write_safetensors

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TENSORS = "state.safetensors"
FORMAT_VERSION = 2  # 2: the global state under param.*/outer.* (swarm.core.state)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what happens instead."""


def save_checkpoint(
    directory: Path,
    *,
    tensors: Optional[dict[str, torch.Tensor]] = None,
    manifest: dict[str, Any] | Callable[[], dict[str, Any]],
    file_digest: bool = True,
    write: Optional[Callable[[BinaryIO], int]] = None,
    durable: bool = True,
    reuse: Optional[Path] = None,
) -> None:
    """Replace the checkpoint in `directory` with these tensors and manifest, atomically. ``file_digest=False``:
    the manifest records no SHA-256 of the file, for tensors that the reader checks against a hash of its own
    (a vote's state hash): one pass over the state fewer on every round. ``write`` (instead of ``tensors``, with
    ``file_digest=False``): writes the tensor file itself and returns its size (a tentative state, stepped once as
    it is written); a callable ``manifest`` is made once the tensors are written.

    ``durable=False``: nothing is fsynced. The checkpoint is still replaced atomically for a killed process (its
    bytes are in the page cache, which outlives it); only a crash of the machine may leave it torn or missing, for
    a reader that checks the tensors' hash to refuse (a vote). ``reuse``: a file of no use any more (an older
    vote's) that becomes the tensor file and is written over: its pages are in the page cache and its blocks on
    disk, where a new file of a GB costs seconds on some machines to have them made."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(directory.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    tensor_path = staging / TENSORS
    reused = False
    if reuse is not None:
        try:
            os.replace(reuse, tensor_path)
            reused = True
        except FileNotFoundError:
            pass
    with open(tensor_path, "r+b" if reused else "w+b", buffering=0) as f:  # readable: a writer may read back
        if write is not None:
            if file_digest:
                raise ValueError("a tensor file written by its own writer carries no digest of the file")
            digest, size = None, write(f)
        else:
            digest, size = write_safetensors(f, tensors or {}, digest=file_digest)
        f.truncate(size)  # a file written over may have been longer
        if durable:
            os.fsync(f.fileno())
    made = manifest() if callable(manifest) else manifest
    record = dict(made, format_version=FORMAT_VERSION, tensors_sha256=digest, tensors_bytes=size)
    with open(staging / MANIFEST, "w") as f:
        f.write(json.dumps(record, sort_keys=True, indent=1))
        f.flush()
        if durable:
            os.fsync(f.fileno())
    if durable:
        _fsync_directory(staging)
    _swap_in(staging, directory, durable=durable)


def _swap_in(staging: Path, directory: Path, *, durable: bool) -> None:
    """Put the complete ``staging`` directory in ``directory``'s place, the old one kept aside until then."""
    previous = directory.with_name(directory.name + ".old")
    if previous.exists():
        shutil.rmtree(previous)
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    if durable:
        _fsync_directory(directory.parent)  # the rename itself survives a power loss
    if previous.exists():
        shutil.rmtree(previous)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _resolve(directory: Path) -> Path:
    directory = Path(directory)
    if not directory.exists() and directory.with_name(directory.name + ".old").exists():
        return directory.with_name(directory.name + ".old")  # a crash between the two renames
    return directory


def read_manifest(directory: Path) -> Optional[dict[str, Any]]:
    """The manifest alone (cheap: no tensor is read or hashed); None when there is no checkpoint.
    Raises CheckpointError for an unreadable one."""
    directory = _resolve(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {directory} was written by another version of Swarm (format "
            f"{manifest.get('format_version') if isinstance(manifest, dict) else '?'}, this one reads "
            f"{FORMAT_VERSION}); it is not used"
        )
    return manifest


def load_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return (tensors, manifest); raises CheckpointError for a missing, truncated or corrupted one."""
    directory = _resolve(directory)
    manifest = read_manifest(directory)
    tensor_path = directory / TENSORS
    if manifest is None or not tensor_path.exists():
        raise CheckpointError(f"no complete checkpoint in {directory}")
    if tensor_path.stat().st_size != manifest.get("tensors_bytes"):
        raise CheckpointError(
            f"checkpoint {tensor_path} is truncated "
            f"({tensor_path.stat().st_size} of {manifest.get('tensors_bytes')} bytes)"
        )
    try:
        tensors, _, digest = map_safetensors(tensor_path, digest=manifest.get("tensors_sha256") is not None)
    except OSError as e:
        raise CheckpointError(f"checkpoint {tensor_path} is unreadable ({e})") from None
    except ValueError as e:  # unreadable bytes: told apart from a damaged file by the hash
        if manifest.get("tensors_sha256") is not None and _sha256(tensor_path) != manifest["tensors_sha256"]:
            raise CheckpointError(
                f"checkpoint {tensor_path} is corrupted (its SHA-256 does not match the manifest)"
            ) from None
        raise CheckpointError(f"checkpoint {tensor_path} is not valid safetensors ({e})") from None
    if manifest.get("tensors_sha256") is not None and digest != manifest["tensors_sha256"]:
        raise CheckpointError(f"checkpoint {tensor_path} is corrupted (its SHA-256 does not match the manifest)")
    return tensors, manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
