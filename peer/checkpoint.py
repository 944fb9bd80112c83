"""A peer's checkpoint on disk: safetensors for tensors, a small JSON manifest for everything else.

Written atomically (a temporary directory, fsync, then one rename), so a crash leaves either the
previous checkpoint or the new one, never half of one. The manifest records the SHA-256 of the
tensor file, so a truncated or corrupted checkpoint is detected and refused with a clear message
instead of being loaded half. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TENSORS = "state.safetensors"
FORMAT_VERSION = 2  # 2: the global state under param.*/outer.* (swarm.core.state)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what happens instead."""


def save_checkpoint(directory: Path, *, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
    """Replace the checkpoint in `directory` with these tensors and manifest, atomically."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(directory.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    tensor_path = staging / TENSORS
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(tensor_path))
    record = dict(manifest, format_version=FORMAT_VERSION, tensors_sha256=_sha256(tensor_path),
                  tensors_bytes=tensor_path.stat().st_size)
    (staging / MANIFEST).write_text(json.dumps(record, sort_keys=True, indent=1))
    for path in (tensor_path, staging / MANIFEST):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    previous = directory.with_name(directory.name + ".old")
    if previous.exists():
        shutil.rmtree(previous)
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    if previous.exists():
        shutil.rmtree(previous)


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
        raise CheckpointError(f"checkpoint {directory} was written by another version of Swarm (format "
                              f"{manifest.get('format_version') if isinstance(manifest, dict) else '?'}, this one reads "
                              f"{FORMAT_VERSION}); it is not used")
    return manifest


def load_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return (tensors, manifest); raises CheckpointError for a missing, truncated or corrupted one."""
    directory = _resolve(directory)
    manifest = read_manifest(directory)
    tensor_path = directory / TENSORS
    if manifest is None or not tensor_path.exists():
        raise CheckpointError(f"no complete checkpoint in {directory}")
    if tensor_path.stat().st_size != manifest.get("tensors_bytes"):
        raise CheckpointError(f"checkpoint {tensor_path} is truncated "
                              f"({tensor_path.stat().st_size} of {manifest.get('tensors_bytes')} bytes)")
    if _sha256(tensor_path) != manifest.get("tensors_sha256"):
        raise CheckpointError(f"checkpoint {tensor_path} is corrupted (its SHA-256 does not match the manifest)")
    try:
        tensors = load_file(str(tensor_path))
    except Exception as e:
        raise CheckpointError(f"checkpoint {tensor_path} is not valid safetensors ({e})") from None
    return tensors, manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
