"""A peer's checkpoint on disk: safetensors for tensors, a small JSON manifest for everything else.

Written atomically (a temporary directory, fsync, then one rename), so a crash leaves either the
previous checkpoint or the new one, never half of one (a vote is not fsynced: ``save_checkpoint``'s ``durable``). The
manifest records the SHA-256 of the tensor file, so a truncated or corrupted checkpoint is detected and refused with a
clear message instead of being loaded half. Nothing is pickled.

Two steps: ``stage_checkpoint`` writes the tensor file in the staging directory straight from the tensors' memory
(``swarm.core.safetensors_io.write_parts``: into the page cache, a copy of bytes and nothing else), after which those
tensors may change; ``StagedCheckpoint.finish`` writes the tensors left for it (``later``: ones that stay put until
then), reads the file back for its SHA-256, fsyncs it, writes the manifest and renames the directory into place.
``CheckpointFinisher`` runs the second step on a thread of its own, so a round pays only for the first
(peer/state/state_store.py). ``save_checkpoint`` is both at once.

The tensor file is safetensors (``safetensors.torch.load_file`` reads it), mapped back (``map_safetensors``): one pass
over the file for its hash, and the tensors are views of a private, copy-on-write mapping. No copy of the whole state
is made either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch

from swarm.core.safetensors_io import IO_BLOCK, SafetensorsLayout, map_safetensors, write_parts

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
    if write is not None and file_digest:
        raise ValueError("a tensor file written by its own writer carries no digest of the file")
    staged = stage_checkpoint(directory, tensors=tensors, manifest=manifest, write=write, reuse=reuse)
    staged.finish(file_digest=file_digest, durable=durable)


@dataclass
class StagedCheckpoint:
    """A checkpoint whose tensor file is written in its staging directory (``stage_checkpoint``), not yet in place:
    all of it, or all but the tensors ``later`` (parts of ``layout``), which ``finish`` writes from their memory."""

    directory: Path
    staging: Path
    size: int
    manifest: dict[str, Any]
    spare: Optional[Path] = None  # where the tensor file of the checkpoint it replaces is kept, to be written over
    layout: Optional[SafetensorsLayout] = None
    later: list[int] = field(default_factory=list)

    def finish(
        self, *, file_digest: bool = True, durable: bool = True, cancelled: Callable[[], bool] = lambda: False
    ) -> bool:
        """Hash the tensor file (``file_digest``), fsync it (``durable``), write the manifest and put the checkpoint
        in place (``save_checkpoint``'s). ``cancelled()``, asked between blocks of the hash: stop and leave the
        checkpoint in place as it was (the staging directory is cleared by the next one); False then."""
        tensor_path = self.staging / TENSORS
        if self.later:
            with open(tensor_path, "r+b", buffering=0) as f:
                write_parts(f, self.layout, self.later)
        self.layout, self.later = None, []  # its tensors are not held any longer
        digest = _file_sha256(tensor_path, self.size, cancelled) if file_digest else None
        if cancelled():
            return False
        if durable:
            _fsync_path(tensor_path)
        record = dict(self.manifest, format_version=FORMAT_VERSION, tensors_sha256=digest, tensors_bytes=self.size)
        with open(self.staging / MANIFEST, "w") as f:
            f.write(json.dumps(record, sort_keys=True, indent=1))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if durable:
            _fsync_directory(self.staging)
        _swap_in(self.staging, self.directory, durable=durable, spare=self.spare)
        return True


def stage_checkpoint(
    directory: Path,
    *,
    tensors: Optional[dict[str, torch.Tensor]] = None,
    manifest: dict[str, Any] | Callable[[], dict[str, Any]],
    write: Optional[Callable[[BinaryIO], int]] = None,
    reuse: Optional[Path] = None,
    spare: Optional[Path] = None,
    later: Callable[[str], bool] = lambda name: False,
) -> StagedCheckpoint:
    """The first step of ``save_checkpoint`` (its arguments): the tensor file written in the staging directory, not
    hashed or fsynced; the tensors may change once it returns, except those whose name is ``later``: ``finish``
    writes them, and they must not change before it has. ``spare``: the file to write over (``reuse``) and, once the
    checkpoint is in place, where the tensor file of the one it replaced is kept for the next."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(directory.name + ".tmp")
    reuse = reuse or spare
    if staging.exists():
        if reuse is not None and not reuse.exists():  # a staged checkpoint that was not finished: written over
            _move_if_there(staging / TENSORS, reuse)
        shutil.rmtree(staging)
    staging.mkdir()
    tensor_path = staging / TENSORS
    reused = reuse is not None and _move_if_there(reuse, tensor_path)
    layout, deferred = None, []
    with open(tensor_path, "r+b" if reused else "w+b", buffering=0) as f:  # readable: a writer may read back
        if write is not None:
            size = write(f)
        else:
            layout = SafetensorsLayout(tensors or {})
            deferred = [i + 1 for i, name in enumerate(layout.names) if later(name)]
            write_parts(f, layout, sorted(set(range(len(layout.starts))) - set(deferred)))
            size = layout.size
        f.truncate(size)  # a file written over may have been longer
    made = manifest() if callable(manifest) else manifest
    return StagedCheckpoint(directory, staging, size, dict(made), spare, layout if deferred else None, deferred)


def _move_if_there(source: Path, target: Path) -> bool:
    try:
        os.replace(source, target)
        return True
    except FileNotFoundError:
        return False


def _file_sha256(path: Path, size: int, cancelled: Callable[[], bool]) -> Optional[str]:
    """The SHA-256 of the file's first ``size`` bytes, read a block at a time into one buffer (a mapping would count
    every page of the file in the process's resident memory; hashlib releases the GIL); None once ``cancelled()``."""
    hasher = hashlib.sha256()
    block = bytearray(min(IO_BLOCK, size))
    with open(path, "rb", buffering=0) as f, memoryview(block) as view:
        left = size
        while left:
            if cancelled():
                return None
            n = f.readinto(view[: min(left, len(block))])
            if not n:
                raise OSError(f"{path} ended {left} bytes early")
            hasher.update(view[:n])
            left -= n
    return hasher.hexdigest()


class CheckpointFinisher:
    """Finishes staged checkpoints (``StagedCheckpoint.finish``) on a thread of its own, one at a time. ``warn``
    is told an OSError that stopped one (a full disk must not stop training; the next checkpoint may succeed)."""

    def __init__(self, warn: Callable[[OSError], None]) -> None:
        self.warn = warn
        self._thread: Optional[threading.Thread] = None
        self._cancel = threading.Event()

    def start(self, staged: StagedCheckpoint) -> None:
        self.wait()
        self._cancel.clear()
        self._thread = threading.Thread(target=self._finish, args=(staged,), name="swarm-checkpoint")
        self._thread.start()

    def _finish(self, staged: StagedCheckpoint) -> None:
        started = time.perf_counter()
        try:
            done = staged.finish(cancelled=self._cancel.is_set)
        except OSError as e:
            self.warn(e)
            return
        logger.info(
            "checkpoint of round %s %s after %.2f s on its own thread (hashed, fsynced, renamed)",
            staged.manifest.get("round"),
            "in place" if done else "given up",
            time.perf_counter() - started,
        )

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, *, cancel: bool = False) -> None:
        """Until the checkpoint being finished is in place (or, ``cancel``: given up, as superseded). Any thread
        may wait; only one starts checkpoints."""
        thread = self._thread
        if thread is not None:
            if cancel:
                self._cancel.set()
            thread.join()


def _swap_in(staging: Path, directory: Path, *, durable: bool, spare: Optional[Path] = None) -> None:
    """Put the complete ``staging`` directory in ``directory``'s place, the old one kept aside until then (its
    tensor file then kept as ``spare``, if given and none is there)."""
    previous = directory.with_name(directory.name + ".old")
    if previous.exists():
        shutil.rmtree(previous)
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    if durable:
        _fsync_directory(directory.parent)  # the rename itself survives a power loss
    if previous.exists():
        if spare is not None and not spare.exists():
            _move_if_there(previous / TENSORS, spare)
        shutil.rmtree(previous)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    _fsync_path(directory)


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
