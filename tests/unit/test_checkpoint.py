"""Checkpoints on disk: round trip, atomic replacement, and refusal of damaged ones."""

import json

import pytest
import torch

from peer.checkpoint import MANIFEST, TENSORS, CheckpointError, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(30)


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"param.0": torch.randn(64, 8, generator=g), "momentum.0": torch.randn(64, 8, generator=g)}


def test_round_trip_keeps_tensors_and_manifest(tmp_path):
    tensors = _state(0)
    save_checkpoint(tmp_path / "ckpt", tensors=tensors, manifest={"round": 7, "hash": "abc"})
    loaded, manifest = load_checkpoint(tmp_path / "ckpt")
    assert manifest["round"] == 7 and manifest["hash"] == "abc"
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_new_checkpoint_replaces_the_old_one_and_leaves_no_staging(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_state(0), manifest={"round": 1})
    save_checkpoint(tmp_path / "ckpt", tensors=_state(1), manifest={"round": 2})
    loaded, manifest = load_checkpoint(tmp_path / "ckpt")
    assert manifest["round"] == 2
    assert torch.equal(loaded["param.0"], _state(1)["param.0"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_truncated_checkpoint_is_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_state(0), manifest={"round": 1})
    path = tmp_path / "ckpt" / TENSORS
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "ckpt")


def test_corrupted_checkpoint_is_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_state(0), manifest={"round": 1})
    path = tmp_path / "ckpt" / TENSORS
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(tmp_path / "ckpt")


def test_missing_or_garbled_manifest_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    save_checkpoint(tmp_path / "ckpt", tensors=_state(0), manifest={"round": 1})
    (tmp_path / "ckpt" / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps({"format_version": 99}))
    with pytest.raises(CheckpointError, match="another version of Swarm"):
        load_checkpoint(tmp_path / "ckpt")


def test_crash_between_renames_still_finds_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_state(0), manifest={"round": 1})
    (tmp_path / "ckpt").rename(tmp_path / "ckpt.old")  # what a crash mid-replacement leaves
    _, manifest = load_checkpoint(tmp_path / "ckpt")
    assert manifest["round"] == 1
