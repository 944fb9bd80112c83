"""The final model file a peer writes: the same θg gives the same bytes, on every peer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from swarm.config import RunConfig
from swarm.core.state import GlobalState
from swarm.train.model.final_model import load_into_model, tensors_digest, write_final_model
from swarm.train.model.run_model import build_run_model

pytestmark = pytest.mark.timeout(60)


def test_peers_holding_the_same_global_parameters_write_byte_identical_final_models(tmp_path: Path) -> None:
    """safetensors writes its metadata from a hash map whose order changes from one map to the next: three peers of a
    WAN run held the same θg and wrote files whose sha256 differed (a few header bytes)."""
    run = RunConfig.from_dict({"model": {"preset": "tiny"}})
    model = build_run_model(run.model, seed=0).module
    state = GlobalState(40, [p.detach().clone() for p in model.parameters()], [])
    paths = [tmp_path / f"peer{i}" / "model.safetensors" for i in range(8)]
    for path in paths:
        path.parent.mkdir()
        write_final_model(path, model, state, run=run)
    assert len({path.read_bytes() for path in paths}) == 1
    assert len({tensors_digest(path) for path in paths}) == 1
    with safe_open(str(paths[0]), "pt") as f:  # still a safetensors file, metadata and all
        assert f.metadata()["round_no"] == "40" and RunConfig.from_json(f.metadata()["run_spec"]) == run
    loaded = load_into_model(paths[0], run)  # what `swarm export` and users load
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), state.params))


def test_a_peers_final_model_names_its_run_and_nothing_else_changes(tmp_path: Path) -> None:
    run = RunConfig.from_dict({"model": {"preset": "bench"}})
    model = build_run_model(run.model, seed=0).module
    state = GlobalState(3, [p.detach().clone() for p in model.parameters()], [])
    write_final_model(tmp_path / "named.safetensors", model, state, run=run, run_id="run-0123456789ab")
    write_final_model(tmp_path / "plain.safetensors", model, state, run=run)
    with (
        safe_open(str(tmp_path / "named.safetensors"), "pt") as named,
        safe_open(str(tmp_path / "plain.safetensors"), "pt") as plain,
    ):
        assert named.metadata() == {**plain.metadata(), "run_id": "run-0123456789ab"}
    assert tensors_digest(tmp_path / "named.safetensors") == tensors_digest(tmp_path / "plain.safetensors")
