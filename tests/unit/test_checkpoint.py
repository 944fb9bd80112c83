"""Checkpoints on disk: round trip, atomic replacement, and refusal of damaged ones."""

import json

import pytest
import torch

from peer.state.checkpoint import MANIFEST, TENSORS, CheckpointError, load_checkpoint, save_checkpoint

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


def _mixed():
    g = torch.Generator().manual_seed(3)
    return {
        "param.00000": torch.randn(33, 7, generator=g),
        "inner.00000.step": torch.tensor(12.0),  # 0-dim
        "inner.00001.count": torch.tensor(5, dtype=torch.int64),
        # 10 bytes: the next tensor would be misaligned after it
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "bytes": torch.arange(7, dtype=torch.uint8),
        "wide": torch.randn(3, generator=g, dtype=torch.float64),
    }


def test_the_streamed_file_is_safetensors_and_its_manifest_hash_is_the_files(tmp_path):
    import hashlib

    from safetensors.torch import load_file

    tensors = _mixed()
    save_checkpoint(tmp_path / "ckpt", tensors=tensors, manifest={"round": 3})
    path = tmp_path / "ckpt" / TENSORS
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["tensors_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["tensors_bytes"] == path.stat().st_size
    by_safetensors = load_file(str(path))
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    assert set(by_safetensors) == set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert by_safetensors[name].dtype == loaded[name].dtype == t.dtype
        assert torch.equal(by_safetensors[name], t) and torch.equal(loaded[name], t), name
    before = path.read_bytes()
    loaded["param.00000"] += 1  # writable (the inner optimizer updates its state in place)...
    assert path.read_bytes() == before  # ...without touching the file: the mapping is private


def test_a_checkpoint_made_by_safetensors_itself_loads(tmp_path):
    """Files of the format written before the streaming writer (safetensors' save_file) still load."""
    import hashlib

    from safetensors.torch import save_file

    tensors = _mixed()
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "ckpt" / TENSORS
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    from peer.state.checkpoint import FORMAT_VERSION

    (tmp_path / "ckpt" / MANIFEST).write_text(
        json.dumps(
            {
                "round": 1,
                "format_version": FORMAT_VERSION,
                "tensors_bytes": path.stat().st_size,
                "tensors_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        )
    )
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_corrupted_header_is_refused_as_corrupted(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_state(0), manifest={"round": 1})
    path = tmp_path / "ckpt" / TENSORS
    data = bytearray(path.read_bytes())
    data[9] ^= 0xFF  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(tmp_path / "ckpt")
